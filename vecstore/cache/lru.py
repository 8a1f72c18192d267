"""LRU: evict the key whose last use is the oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable

from vecstore.cache.base import (
    POLICIES,
    check_absent,
    check_capacity,
    first_unprotected,
    not_resident,
)

__all__ = ["LRUPolicy"]


@POLICIES.register("lru")
class LRUPolicy:
    """Least recently used: admission and every hit count as a use.

    Parameters
    ----------
    capacity : int
        Most keys resident at once, >= 1.

    Examples
    --------
    >>> p = LRUPolicy(2)
    >>> p.admit(1), p.admit(2)
    ([], [])
    >>> p.touch(1)
    >>> p.admit(3)
    [2]
    >>> p.admit(4, protected={1})
    [3]
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_capacity(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # least recent first

    @property
    def capacity(self) -> int:
        """Most keys resident at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def touch(self, key: Hashable) -> None:
        """Mark ``key`` as the most recently used."""
        if key not in self._order:
            raise not_resident(key)
        self._order.move_to_end(key)

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Insert ``key`` as most recent, evicting the least recent unprotected key if full."""
        check_absent(self, key)
        evicted = []
        if len(self._order) >= self._capacity:
            victim = first_unprotected(self._order, protected, key)
            del self._order[victim]
            evicted.append(victim)
        self._order[key] = None
        return evicted

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if resident."""
        self._order.pop(key, None)

    def keys(self) -> list[Hashable]:
        """Resident keys, least recently used first."""
        return list(self._order)
