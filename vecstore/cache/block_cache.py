"""BlockCache: a fixed pool of cluster slots for one layer, managed by a replacement policy.

A step goes ``lookup`` (which requested clusters are resident, and in which slots) then
``admit`` (the policy bookkeeping: hits are touched, misses get slots). ``admit`` can
run on a worker thread with ``submit_step``, off the critical path; the next ``lookup``
waits for it, so both paths give identical results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import cast

import torch

from vecstore.cache.base import CachePolicy, make_policy
from vecstore.checks import check_tensor
from vecstore.errors import InvalidValueError, ShapeError

__all__ = ["BlockCache", "CacheStats", "Lookup", "HeadLookup", "Admission", "HeadAdmission"]

HeadId = tuple[int, int]  # (sequence id, kv head)
Key = tuple[int, int, int]  # (sequence id, kv head, cluster id)
Requests = Mapping[HeadId, Sequence[int] | torch.Tensor]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of a block cache since it was built.

    Attributes
    ----------
    hits : int
        Requested clusters that were resident.
    misses : int
        Requested clusters that were not (admitted or not); ``hits + misses`` is the
        number of requests.
    evictions : int
        Resident clusters evicted to make room.
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def requests(self) -> int:
        """Clusters requested in all admitted steps."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """``hits / requests``, 0.0 before any request."""
        return self.hits / self.requests if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class HeadLookup:
    """Hits and misses of one (sequence, KV head), in request order.

    Attributes
    ----------
    hit_clusters : torch.Tensor
        ``[h]`` int64 resident cluster ids.
    hit_slots : torch.Tensor
        ``[h]`` int64 slot of each resident cluster.
    miss_clusters : torch.Tensor
        ``[m]`` int64 cluster ids that are not resident.
    """

    hit_clusters: torch.Tensor
    hit_slots: torch.Tensor
    miss_clusters: torch.Tensor


@dataclass(frozen=True, slots=True)
class Lookup:
    """One step's lookup; pass it to :meth:`BlockCache.admit` before the next lookup.

    Attributes
    ----------
    heads : dict[tuple[int, int], HeadLookup]
        Per ``(sequence id, kv head)``, in request order.
    generation : int
        State of the cache it was made against; an older one is rejected.
    """

    heads: dict[HeadId, HeadLookup]
    generation: int

    @property
    def num_hits(self) -> int:
        """Resident clusters over all heads."""
        return sum(len(h.hit_clusters) for h in self.heads.values())

    @property
    def num_misses(self) -> int:
        """Non-resident clusters over all heads."""
        return sum(len(h.miss_clusters) for h in self.heads.values())


@dataclass(frozen=True, slots=True)
class HeadAdmission:
    """What happened to the misses of one (sequence, KV head), in request order.

    Attributes
    ----------
    clusters : torch.Tensor
        ``[a]`` int64 missed cluster ids now resident.
    slots : torch.Tensor
        ``[a]`` int64 slot each was given: copy its block there.
    rejected : torch.Tensor
        ``[r]`` int64 missed cluster ids not admitted, because every slot holds a
        cluster of this step.
    """

    clusters: torch.Tensor
    slots: torch.Tensor
    rejected: torch.Tensor


@dataclass(frozen=True, slots=True)
class Admission:
    """The bookkeeping of one step.

    Attributes
    ----------
    heads : dict[tuple[int, int], HeadAdmission]
        Per ``(sequence id, kv head)`` of the lookup.
    evicted : list[tuple[int, int, int]]
        ``(sequence id, kv head, cluster id)`` keys evicted, in eviction order; their
        slots now belong to admitted clusters.
    """

    heads: dict[HeadId, HeadAdmission]
    evicted: list[Key]


class BlockCache:
    """A pool of ``num_slots`` cluster slots for one layer, keyed by (sequence, head, cluster).

    Clusters requested in a step are never evicted to make room for another cluster
    of the same step: when a step requests more distinct clusters than there are
    slots, the misses that do not fit are reported as rejected. The cache never holds
    more than ``num_slots`` clusters. Use it from one thread.

    Parameters
    ----------
    num_slots : int
        Slots in the pool, >= 1.
    policy : str or CachePolicy
        A name from :data:`vecstore.cache.POLICIES` (``lru`` by default), or an empty
        policy instance with ``capacity == num_slots``.
    executor : concurrent.futures.Executor, optional
        Where :meth:`submit_step` runs; by default a one-thread pool owned by the cache
        (shut down by :meth:`close`). Share one pool among layers to bound threads.

    Examples
    --------
    >>> cache = BlockCache(2)
    >>> step = cache.lookup({(0, 0): [5, 7, 9]})
    >>> step.num_hits, step.num_misses
    (0, 3)
    >>> head = cache.admit(step).heads[(0, 0)]
    >>> head.clusters.tolist(), head.slots.tolist(), head.rejected.tolist()
    ([5, 7], [0, 1], [9])
    >>> step = cache.lookup({(0, 0): [7, 9]})
    >>> step.heads[(0, 0)].hit_slots.tolist()
    [1]
    >>> cache.submit_step(step).result().evicted
    [(0, 0, 5)]
    >>> cache.stats
    CacheStats(hits=1, misses=4, evictions=1)
    >>> cache.close()
    """

    def __init__(self, num_slots: int, *, policy: str | CachePolicy = "lru",
                 executor: Executor | None = None) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise InvalidValueError(f"num_slots: expected an integer >= 1, got {num_slots!r}")
        if isinstance(policy, str):
            policy = make_policy(policy, num_slots)
        elif not isinstance(policy, CachePolicy):
            raise InvalidValueError(
                f"policy: expected a policy name or a CachePolicy, got {type(policy).__name__}"
            )
        elif policy.capacity != num_slots or len(policy) != 0:
            raise InvalidValueError(
                f"policy: expected an empty policy of capacity {num_slots}, got capacity "
                f"{policy.capacity} holding {len(policy)} keys"
            )
        self.num_slots = num_slots
        self._policy = policy
        self._executor = executor
        self._owns_executor = executor is None
        self._pending: Future[Admission] | None = None
        self._slots: dict[Key, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._generation = 0
        self._stats = CacheStats()

    @property
    def policy(self) -> CachePolicy:
        """The replacement policy."""
        return self._policy

    @property
    def stats(self) -> CacheStats:
        """Hit and miss counters, after any pending step."""
        self.wait()
        return self._stats

    def __len__(self) -> int:
        self.wait()
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        self.wait()
        return key in self._slots

    def lookup(self, requests: Requests) -> Lookup:
        """Split one step's requested clusters into hits (with slots) and misses.

        Parameters
        ----------
        requests : Mapping[tuple[int, int], Sequence[int] | torch.Tensor]
            Per ``(sequence id, kv head)``, distinct non-negative cluster ids: a list
            or a ``[R]`` integer tensor.

        Returns
        -------
        Lookup
            Nothing changes until it is passed to :meth:`admit` or :meth:`submit_step`.
        """
        parsed = _parse_requests(requests)
        self.wait()
        heads = {}
        for (seq, head), clusters in parsed.items():
            slots = [self._slots.get((seq, head, c), -1) for c in clusters]
            hits = [(c, s) for c, s in zip(clusters, slots, strict=True) if s >= 0]
            heads[(seq, head)] = HeadLookup(
                hit_clusters=_ids([c for c, _ in hits]),
                hit_slots=_ids([s for _, s in hits]),
                miss_clusters=_ids([c for c, s in zip(clusters, slots, strict=True) if s < 0]),
            )
        return Lookup(heads=heads, generation=self._generation)

    def admit(self, lookup: Lookup) -> Admission:
        """Run the step's bookkeeping: touch its hits, give its misses slots.

        Raises
        ------
        InvalidValueError
            ``lookup`` is stale: the cache changed after it was made.
        """
        self.wait()
        self._check_current(lookup)
        return self._admit(lookup)

    def submit_step(self, lookup: Lookup) -> Future[Admission]:
        """Run :meth:`admit` on the executor; the next call on the cache waits for it."""
        self.wait()
        self._check_current(lookup)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="vecstore-cache")
        self._pending = self._executor.submit(self._admit, lookup)
        return self._pending

    def wait(self) -> Admission | None:
        """Block until the submitted step is done and return it (``None`` if none was)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def drop_sequence(self, seq: int) -> int:
        """Free every slot of sequence ``seq``; return how many were freed."""
        self.wait()
        keys = [k for k in self._slots if k[0] == seq]
        for key in keys:
            self._policy.discard(key)
            self._free.append(self._slots.pop(key))
        self._generation += 1
        return len(keys)

    def close(self) -> None:
        """Wait for the pending step and shut down an owned executor; safe to repeat."""
        self.wait()
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __enter__(self) -> BlockCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _check_current(self, lookup: Lookup) -> None:
        if not isinstance(lookup, Lookup):
            raise InvalidValueError(f"lookup: expected a Lookup, got {type(lookup).__name__}")
        if lookup.generation != self._generation:
            raise InvalidValueError(
                "lookup: stale, the cache changed after it was made; call lookup() again"
            )

    def _admit(self, lookup: Lookup) -> Admission:
        step_keys = {
            (seq, head, c)
            for (seq, head), h in lookup.heads.items()
            for part in (h.hit_clusters, h.miss_clusters)
            for c in part.tolist()
        }
        for (seq, head), h in lookup.heads.items():
            for c in h.hit_clusters.tolist():
                self._policy.touch((seq, head, c))
        num_pinned = lookup.num_hits  # resident clusters of this step
        evicted: list[Key] = []
        heads = {}
        for (seq, head), h in lookup.heads.items():
            admitted, slots, rejected = [], [], []
            for c in h.miss_clusters.tolist():
                if num_pinned >= self.num_slots:
                    rejected.append(c)
                    continue
                key = (seq, head, c)
                for victim in self._policy.admit(key, protected=step_keys):
                    self._free.append(self._slots.pop(cast(Key, victim)))
                    evicted.append(cast(Key, victim))
                self._slots[key] = slot = self._free.pop()
                admitted.append(c)
                slots.append(slot)
                num_pinned += 1
            heads[(seq, head)] = HeadAdmission(_ids(admitted), _ids(slots), _ids(rejected))
        s = self._stats
        self._stats = CacheStats(
            hits=s.hits + lookup.num_hits,
            misses=s.misses + lookup.num_misses,
            evictions=s.evictions + len(evicted),
        )
        self._generation += 1
        return Admission(heads=heads, evicted=evicted)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _parse_requests(requests: object) -> dict[HeadId, list[int]]:
    """Check a step's requests and return them as lists of ints."""
    if not isinstance(requests, Mapping):
        raise InvalidValueError(
            f"requests: expected a mapping (seq, head) -> cluster ids, got "
            f"{type(requests).__name__}"
        )
    out: dict[HeadId, list[int]] = {}
    for head_id, clusters in requests.items():
        if not (isinstance(head_id, tuple) and len(head_id) == 2
                and all(_is_index(v) for v in head_id)):
            raise InvalidValueError(
                f"requests: keys must be (sequence id, kv head) pairs of non-negative "
                f"ints, got {head_id!r}"
            )
        name = f"requests[{head_id!r}]"
        if isinstance(clusters, torch.Tensor):
            check_tensor(clusters, name, shape=(None,))
            if clusters.dtype.is_floating_point or clusters.dtype.is_complex or (
                clusters.dtype == torch.bool
            ):
                raise ShapeError(f"{name}: expected an integer tensor, got {clusters.dtype}")
            ids = clusters.tolist()
        elif isinstance(clusters, Sequence) and all(isinstance(c, int) for c in clusters):
            ids = list(clusters)
        else:
            raise InvalidValueError(f"{name}: expected a list or 1-D tensor of cluster ids")
        if not all(_is_index(c) for c in ids):
            raise InvalidValueError(f"{name}: cluster ids must be non-negative ints, got {ids}")
        if len(set(ids)) != len(ids):
            dup = next(c for c in ids if ids.count(c) > 1)
            raise InvalidValueError(f"{name}: cluster ids must be distinct, {dup} repeats")
        out[(head_id[0], head_id[1])] = ids
    return out


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
