"""FIFO: evict the key admitted the longest ago; hits change nothing."""

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

__all__ = ["FIFOPolicy"]


@POLICIES.register("fifo")
class FIFOPolicy:
    """First in, first out: eviction order is admission order.

    Parameters
    ----------
    capacity : int
        Most keys resident at once, >= 1.

    Examples
    --------
    >>> p = FIFOPolicy(2)
    >>> p.admit(1), p.admit(2)
    ([], [])
    >>> p.touch(1)
    >>> p.admit(3)
    [1]
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_capacity(capacity)
        self._queue: OrderedDict[Hashable, None] = OrderedDict()  # oldest admission first

    @property
    def capacity(self) -> int:
        """Most keys resident at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, key: object) -> bool:
        return key in self._queue

    def touch(self, key: Hashable) -> None:
        """Check that ``key`` is resident; FIFO ignores hits."""
        if key not in self._queue:
            raise not_resident(key)

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Append ``key``, evicting the oldest unprotected admission if full."""
        check_absent(self, key)
        evicted = []
        if len(self._queue) >= self._capacity:
            victim = first_unprotected(self._queue, protected, key)
            del self._queue[victim]
            evicted.append(victim)
        self._queue[key] = None
        return evicted

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if resident."""
        self._queue.pop(key, None)

    def keys(self) -> list[Hashable]:
        """Resident keys, oldest admission first."""
        return list(self._queue)
