"""S3-FIFO: three static FIFO queues (Yang et al., "FIFO queues are all you need", SOSP 2023)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable
from itertools import chain

from vecstore.policies.base import (
    POLICIES,
    check_absent,
    check_capacity,
    first_unprotected,
    not_resident,
)

__all__ = ["S3FIFOPolicy"]

_MAX_FREQ = 3  # two bits of access count per key


@POLICIES.register("s3fifo")
class S3FIFOPolicy:
    """S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, and a ghost FIFO.

    New keys enter the small queue ``S`` (10% of capacity, at least one key) unless the
    ghost queue ``G`` remembers them, in which case they enter the main queue ``M``.
    Hits raise a key's count, capped at 3. When ``S`` holds its share, its oldest key
    leaves: to ``M`` (count cleared) if it was hit while in ``S``, else out of the cache
    and into ``G``. Otherwise ``M`` evicts: its oldest key is reinserted at the tail
    with its count decreased while the count is positive, else evicted. ``G`` keeps as
    many keys as ``M``'s share. Quickly demoting keys seen once keeps one-off requests
    from flushing the keys that are reused.

    Each admission into a full cache evicts exactly one key (the paper's loop may evict
    one from ``S`` after a promotion already evicted one from ``M``; a fixed slot pool
    keeps the slot instead). A protected key that an eviction passes goes to the tail of
    its queue with its count unchanged, as it is in use. Operations take constant time
    on average, except while one step's protected admissions fill all of ``S``: each
    further eviction then scans ``S`` once before turning to ``M``.

    Parameters
    ----------
    capacity : int
        Most keys resident at once, >= 1.

    Examples
    --------
    >>> p = S3FIFOPolicy(10)  # S holds 1 key, M 9
    >>> [p.admit(k) for k in range(10)][-1]
    []
    >>> p.touch(9)
    >>> p.admit(10)  # S is over its share: 0 was never hit, so it is evicted
    [0]
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_capacity(capacity)
        self._small_capacity = max(1, capacity // 10)
        self._main_capacity = capacity - self._small_capacity
        self._small: OrderedDict[Hashable, int] = OrderedDict()  # key -> count, oldest first
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        """Most keys resident at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def touch(self, key: Hashable) -> None:
        """Add one to the access count of ``key`` (at most 3)."""
        queue = self._small if key in self._small else self._main
        if key not in queue:
            raise not_resident(key)
        queue[key] = min(queue[key] + 1, _MAX_FREQ)

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Insert ``key`` into ``M`` after a ghost hit, else into ``S``; evict one if full."""
        check_absent(self, key)
        evicted = []
        if len(self) >= self._capacity:
            first_unprotected(chain(self._main, self._small), protected, key)
            evicted.append(self._evict(protected))
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0
        return evicted

    def discard(self, key: Hashable) -> None:
        """Forget ``key``, resident or ghost."""
        for queue in (self._small, self._main, self._ghost):
            queue.pop(key, None)

    def keys(self) -> list[Hashable]:
        """Resident keys: ``S`` then ``M``, each oldest first."""
        return [*self._small, *self._main]

    def _evict(self, protected: Container[Hashable]) -> Hashable:
        # scans stop at the first unprotected key; passing a fully protected S (a step
        # that admits more than S's share) in Python would cost a rotation per key
        if any(k not in protected for k in self._small) and (
            len(self._small) >= self._small_capacity
            or all(k in protected for k in self._main)
        ):
            evicted = self._evict_small(protected)
            if evicted:
                return evicted[0]
        return self._evict_main(protected)

    def _evict_small(self, protected: Container[Hashable]) -> list[Hashable]:
        """Drain S from its head until one key leaves the cache; [] if none did."""
        for _ in range(len(self._small)):  # visit each key at most once
            key, count = self._small.popitem(last=False)
            if key in protected:
                self._small[key] = count
            elif count > 0:  # reused while on probation: promote with a clear count
                self._main[key] = 0
                if len(self._main) > self._main_capacity:
                    return [self._evict_main(protected)]
            else:
                self._ghost[key] = None
                if len(self._ghost) > self._main_capacity:
                    self._ghost.popitem(last=False)
                return [key]
        return []

    def _evict_main(self, protected: Container[Hashable]) -> Hashable:
        """FIFO with reinsertion over M; the caller ensures M has an unprotected key."""
        while True:
            key, count = self._main.popitem(last=False)
            if key in protected:
                self._main[key] = count
            elif count > 0:
                self._main[key] = count - 1
            else:
                return key
