"""LFU: evict the key with the fewest uses; ties go to the least recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterator

from vecstore.policies.base import (
    POLICIES,
    check_absent,
    check_capacity,
    first_unprotected,
    not_resident,
)

__all__ = ["LFUPolicy"]


@POLICIES.register("lfu")
class LFUPolicy:
    """Least frequently used, counting admission as one use and each hit as one more.

    A key's count starts again from 1 when it is re-admitted after an eviction. Among
    keys with the lowest count, the one used least recently is evicted.

    Parameters
    ----------
    capacity : int
        Most keys resident at once, >= 1.

    Examples
    --------
    >>> p = LFUPolicy(2)
    >>> p.admit("a"), p.admit("b")
    ([], [])
    >>> p.touch("a"); p.touch("a"); p.touch("b")
    >>> p.admit("c")
    ['b']
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_capacity(capacity)
        self._count: dict[Hashable, int] = {}
        # count -> keys with that count, least recently used first
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}

    @property
    def capacity(self) -> int:
        """Most keys resident at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def touch(self, key: Hashable) -> None:
        """Add one use to ``key``."""
        if key not in self._count:
            raise not_resident(key)
        count = self._count[key]
        self._remove(key, count)
        self._insert(key, count + 1)

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Insert ``key`` with one use, evicting the least used unprotected key if full."""
        check_absent(self, key)
        evicted = []
        if len(self._count) >= self._capacity:
            victim = first_unprotected(self._eviction_order(), protected, key)
            self._remove(victim, self._count.pop(victim))
            evicted.append(victim)
        self._insert(key, 1)
        return evicted

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` and its count if resident."""
        if key in self._count:
            self._remove(key, self._count.pop(key))

    def keys(self) -> list[Hashable]:
        """Resident keys in eviction order: fewest uses first, then least recent."""
        return list(self._eviction_order())

    def _eviction_order(self) -> Iterator[Hashable]:
        for count in sorted(self._buckets):
            yield from self._buckets[count]

    def _insert(self, key: Hashable, count: int) -> None:
        self._count[key] = count
        self._buckets.setdefault(count, OrderedDict())[key] = None

    def _remove(self, key: Hashable, count: int) -> None:
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
