"""Replacement-policy bookkeeping of the GPU block cache, on a CPU worker thread.

The GPU decides hits and misses from its slot table and gives each admitted miss the next
usable slot of a *victim list*. This module keeps one :class:`~vecstore.policies.CachePolicy`
per (sequence, KV head) row in step with what the GPU did (hits are touched, evicted
clusters discarded, admitted ones admitted) and publishes a fresh victim list: free slots
first, then resident slots in the policy's eviction order. All of it runs on a worker
thread, after the step's small record has been copied to the host, so the policy never
sits on the GPU's critical path; the GPU keeps using the previous list until a new one
arrives.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from vecstore.buffer.recency import RECENCY, RecencyOrder
from vecstore.policies import CachePolicy, make_policy

__all__ = ["StepRecord", "PolicyBookkeeper", "RecordPool"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did to the cache, as host tensors (rows ``b * Hkv + h``).

    Attributes
    ----------
    ids : torch.Tensor
        ``[rows, R]`` int32 retrieved clusters (first ``count[row]`` valid).
    slot : torch.Tensor
        ``[rows, R]`` int32 slot of each hit, -1 for a miss.
    admitted : torch.Tensor
        ``[rows, R]`` int32 slot each miss was given, -1 if not admitted.
    evicted : torch.Tensor
        ``[rows, R]`` int32 cluster that held that slot before, -1 if it was free.
    count : torch.Tensor
        ``[rows]`` int32.
    ready : torch.cuda.Event | None
        Completes when the copies above have landed (``None`` on CPU).
    """

    ids: torch.Tensor
    slot: torch.Tensor
    admitted: torch.Tensor
    evicted: torch.Tensor
    count: torch.Tensor
    ready: torch.cuda.Event | None


class RecordPool:
    """Pinned host records of a CUDA buffer's steps, reused once the worker applied them.

    A step copies its record to pinned host memory for the policy worker; allocating five
    pinned tensors and an event for every layer of every step is host time the decode loop
    waits for. A record is taken from the pool when the worker is done with it (its
    submission's future completed), else a new one is made; at most ``size`` are kept.

    Parameters
    ----------
    parts : list[torch.Tensor]
        The device tensors of a record, in :class:`StepRecord`'s order (shapes and dtypes).
    size : int
        Records kept for reuse.
    """

    def __init__(self, parts: list[torch.Tensor], size: int = 4) -> None:
        self._shapes = [(tuple(p.shape), p.dtype) for p in parts]
        self._size = size
        self._kept: deque[tuple[StepRecord, Future[None]]] = deque()

    def take(self) -> StepRecord:
        """A record free to be written (copies into it may start now): the oldest kept one
        the worker is done with, else a new one."""
        if self._kept and self._kept[0][1].done():
            return self._kept.popleft()[0]
        host = [torch.empty(shape, dtype=dtype, pin_memory=True) for shape, dtype in self._shapes]
        return StepRecord(*host, ready=torch.cuda.Event())

    def track(self, record: StepRecord, applied: Future[None]) -> None:
        """Keep ``record`` for reuse once ``applied`` completes."""
        if len(self._kept) < self._size:
            self._kept.append((record, applied))


class PolicyBookkeeper:
    """Per-row replacement policies fed with step records on a worker thread.

    Parameters
    ----------
    rows : int
        Independent caches (sequence, KV head pairs).
    num_slots : int
        Slots per row.
    policy : str
        A name from :data:`vecstore.policies.POLICIES`.
    executor : concurrent.futures.Executor, optional
        Where records are applied; by default a one-thread pool owned by this object.

    Examples
    --------
    >>> bk = PolicyBookkeeper(1, 2, "lru")
    >>> t = lambda *v: torch.tensor([list(v)], dtype=torch.int32)
    >>> rec = StepRecord(t(5, 7), t(-1, -1), t(0, 1), t(-1, -1), torch.tensor([2]), None)
    >>> bk.submit(rec).result()
    >>> rec = StepRecord(t(5, 0), t(0, -1), t(-1, -1), t(-1, -1), torch.tensor([1]), None)
    >>> bk.submit(rec).result()
    >>> bk.take_victims().tolist()  # slot 1 (cluster 7) is now the least recently used
    [[1, 0]]
    >>> bk.close()
    """

    def __init__(self, rows: int, num_slots: int, policy: str = "lru", *,
                 executor: Executor | None = None) -> None:
        self.rows = rows
        self.num_slots = num_slots
        self._recency = RecencyOrder(rows, num_slots, policy) if policy in RECENCY else None
        self._policies: list[CachePolicy] = [] if self._recency else [
            make_policy(policy, num_slots) for _ in range(rows)]
        self._slot_of: list[dict[int, int]] = [{} for _ in self._policies]
        self._executor = executor
        self._owns = executor is None
        self._lock = threading.Lock()
        self._published: torch.Tensor | None = None
        self._pending: list[Future[None]] = []
        self._submitted = 0
        self.applied = 0
        self.published = 0

    def submit(self, record: StepRecord) -> Future[None]:
        """Apply ``record`` on the worker (records are applied in submission order)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="vecstore-policy")
        self._pending = [f for f in self._pending if not f.done()]
        with self._lock:
            self._submitted += 1
        fut = self._executor.submit(self._apply, record)
        self._pending.append(fut)
        return fut

    @property
    def lag(self) -> int:
        """Records submitted but not yet applied."""
        return sum(not f.done() for f in self._pending)

    def take_victims(self) -> torch.Tensor | None:
        """The newest published ``[rows, num_slots]`` int32 victim list, once; else ``None``.

        A record applied while a later one waits publishes nothing (``published`` counts
        the lists that were): when the worker falls behind, as where a row has thousands of
        slots, it skips the copies into pinned memory no step would install, and an LRU or
        FIFO order folds the waiting records in with the newest, in one pass over the
        slots (:meth:`~vecstore.buffer.recency.RecencyOrder.defer`)."""
        with self._lock:
            out, self._published = self._published, None
        return out

    def wait(self) -> None:
        """Block until every submitted record is applied."""
        for f in self._pending:
            f.result()
        self._pending = []

    def close(self) -> None:
        """Finish pending records and stop an owned worker; safe to repeat."""
        self.wait()
        if self._owns and self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def _apply(self, rec: StepRecord) -> None:
        if rec.ready is not None:
            rec.ready.synchronize()
        ids, slot = rec.ids.numpy(), rec.slot.numpy()
        admitted, evicted = rec.admitted.numpy(), rec.evicted.numpy()
        with self._lock:
            newer = self._submitted > self.applied + 1
        if self._recency is not None and newer:  # folded with the newest, at once
            self._recency.defer(slot, admitted, rec.count.numpy())
        elif self._recency is not None:
            victims = self._recency.apply(slot, admitted, rec.count.numpy())
        else:
            victims = self._apply_policies(ids, slot, admitted, evicted, rec.count.tolist())
        with self._lock:
            self.applied += 1
        if newer:  # a later record is queued: only the newest list is ever installed
            return
        out = torch.from_numpy(victims)
        if torch.cuda.is_available():
            out = out.pin_memory()
        with self._lock:
            self._published = out
            self.published += 1

    def _apply_policies(self, ids: np.ndarray, slot: np.ndarray, admitted: np.ndarray,
                        evicted: np.ndarray, counts: list[int]) -> np.ndarray:
        # one CachePolicy per row, fed cluster by cluster; the victim list from its order
        for row, n in enumerate(counts):
            pol, where = self._policies[row], self._slot_of[row]
            for c, s, a, e in zip(ids[row, :n].tolist(), slot[row, :n].tolist(),
                                  admitted[row, :n].tolist(), evicted[row, :n].tolist(),
                                  strict=True):
                if s >= 0:
                    if c in pol:  # a policy may have let go of a cluster the GPU still holds
                        pol.touch(c)
                elif a >= 0:
                    if e >= 0:
                        pol.discard(e)
                        where.pop(e, None)
                    pol.admit(c)
                    where[c] = a
        victims = np.empty((self.rows, self.num_slots), dtype=np.int32)
        for row in range(self.rows):
            where = self._slot_of[row]
            used = np.fromiter((where[k] for k in self._policies[row].keys()), np.int32)
            free = np.setdiff1d(np.arange(self.num_slots, dtype=np.int32), used,
                                assume_unique=True)
            victims[row] = np.concatenate([free, used])
        return victims
