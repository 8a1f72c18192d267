"""Memory tiers for KV rows, by kind in :data:`KVSTORES`: GPU-resident (``memory``) and pinned
host memory (``pinned``); a store's :class:`Placement` builds the configured one."""

from vecstore.kvstore.base import KVSTORES as KVSTORES
from vecstore.kvstore.base import KVStore as KVStore
from vecstore.kvstore.base import MemoryAccount as MemoryAccount
from vecstore.kvstore.base import StoredRows as StoredRows
from vecstore.kvstore.base import make_kvstore as make_kvstore
from vecstore.kvstore.gpu import GPUKVStore as GPUKVStore
from vecstore.kvstore.pinned import PinnedKVStore as PinnedKVStore
from vecstore.kvstore.placement import Placement as Placement

__all__ = ["KVSTORES", "KVStore", "MemoryAccount", "StoredRows", "GPUKVStore", "PinnedKVStore",
           "Placement", "make_kvstore"]
