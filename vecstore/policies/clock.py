"""CLOCK: FIFO with a second chance for keys hit since the hand last passed them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable

from vecstore.policies.base import (
    POLICIES,
    check_absent,
    check_capacity,
    first_unprotected,
    not_resident,
)

__all__ = ["ClockPolicy"]


@POLICIES.register("clock")
class ClockPolicy:
    """CLOCK (second chance), Corbató 1968: an approximation of LRU with one bit per key.

    Keys sit on a ring with a hand. A hit sets the key's reference bit. To make room,
    the hand sweeps: a key with its bit set has the bit cleared and is passed; the first
    key with a clear bit is evicted and the new key takes its place just behind the
    hand, with a clear bit. Protected keys are passed unchanged.

    The ring is kept as a queue whose head is under the hand: passing a key moves it to
    the tail, which is exactly where the hand reaches it last.

    Parameters
    ----------
    capacity : int
        Most keys resident at once, >= 1.

    Examples
    --------
    >>> p = ClockPolicy(3)
    >>> [p.admit(k) for k in "abc"]
    [[], [], []]
    >>> p.touch("a")
    >>> p.admit("d")
    ['b']
    >>> p.keys()
    ['c', 'a', 'd']
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_capacity(capacity)
        self._ring: OrderedDict[Hashable, bool] = OrderedDict()  # key -> reference bit

    @property
    def capacity(self) -> int:
        """Most keys resident at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._ring)

    def __contains__(self, key: object) -> bool:
        return key in self._ring

    def touch(self, key: Hashable) -> None:
        """Set the reference bit of ``key``."""
        if key not in self._ring:
            raise not_resident(key)
        self._ring[key] = True

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Place ``key`` behind the hand, first sweeping to evict a key if full."""
        check_absent(self, key)
        evicted = []
        if len(self._ring) >= self._capacity:
            first_unprotected(self._ring, protected, key)  # a victim exists: the sweep ends
            evicted.append(self._sweep(protected))
        self._ring[key] = False
        return evicted

    def discard(self, key: Hashable) -> None:
        """Take ``key`` off the ring if resident."""
        self._ring.pop(key, None)

    def keys(self) -> list[Hashable]:
        """Resident keys in the order the hand reaches them."""
        return list(self._ring)

    def _sweep(self, protected: Container[Hashable]) -> Hashable:
        while True:
            key, referenced = next(iter(self._ring.items()))
            if referenced and key not in protected:
                self._ring[key] = False
            elif key not in protected:
                del self._ring[key]
                return key
            self._ring.move_to_end(key)
