"""Replacement policies of the GPU block cache in front of offloaded KV.

The block cache itself is the wave buffer's (:class:`vecstore.buffer.WaveBuffer`); a policy
only keeps the bookkeeping of which clusters stay. Policies are chosen by name (config key
``cache.policy``) from :data:`POLICIES`.
"""

from vecstore.policies.arc import ARCPolicy as ARCPolicy
from vecstore.policies.base import POLICIES as POLICIES
from vecstore.policies.base import CachePolicy as CachePolicy
from vecstore.policies.base import make_policy as make_policy
from vecstore.policies.clock import ClockPolicy as ClockPolicy
from vecstore.policies.fifo import FIFOPolicy as FIFOPolicy
from vecstore.policies.lfu import LFUPolicy as LFUPolicy
from vecstore.policies.lru import LRUPolicy as LRUPolicy
from vecstore.policies.s3fifo import S3FIFOPolicy as S3FIFOPolicy

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
