"""Memory tiers for KV rows: GPU-resident (``memory``) and pinned host memory (``pinned``)."""

from vecstore.kvstore.base import KVSTORES as KVSTORES
from vecstore.kvstore.base import KVStore as KVStore
from vecstore.kvstore.base import MemoryAccount as MemoryAccount
from vecstore.kvstore.base import StoredRows as StoredRows
from vecstore.kvstore.gpu import GPUKVStore as GPUKVStore
from vecstore.kvstore.pinned import PinnedKVStore as PinnedKVStore
from vecstore.kvstore.placement import Placement as Placement

__all__ = ["KVSTORES", "KVStore", "MemoryAccount", "StoredRows", "GPUKVStore", "PinnedKVStore",
           "Placement", "make_kvstore"]


def make_kvstore(kind: str, *, device: str = "cpu", budget_gb: float = 0.0) -> KVStore:
    """The tier registered as ``kind`` (``memory`` on ``device``, or ``pinned``)."""
    cls = KVSTORES.get(kind)
    if kind == "memory":
        return cls(device, budget_gb=budget_gb)  # type: ignore[no-any-return]
    return cls(budget_gb=budget_gb)  # type: ignore[no-any-return]
