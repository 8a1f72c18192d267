"""Replacement policies of the GPU block cache in front of offloaded KV.

The block cache itself is the wave buffer's (:class:`vecstore.buffer.WaveBuffer`); a policy
only keeps the bookkeeping of which clusters stay. Policies are chosen by name (config key
``cache.policy``) from :data:`POLICIES`.
"""

from vecstore.cache.arc import ARCPolicy as ARCPolicy
from vecstore.cache.base import POLICIES as POLICIES
from vecstore.cache.base import CachePolicy as CachePolicy
from vecstore.cache.base import make_policy as make_policy
from vecstore.cache.clock import ClockPolicy as ClockPolicy
from vecstore.cache.fifo import FIFOPolicy as FIFOPolicy
from vecstore.cache.lfu import LFUPolicy as LFUPolicy
from vecstore.cache.lru import LRUPolicy as LRUPolicy
from vecstore.cache.s3fifo import S3FIFOPolicy as S3FIFOPolicy

__all__ = [
    "POLICIES",
    "CachePolicy",
    "make_policy",
    "LRUPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "ClockPolicy",
    "ARCPolicy",
    "S3FIFOPolicy",
]
