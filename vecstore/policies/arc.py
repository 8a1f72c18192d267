"""ARC: adaptive replacement between recency and frequency (Megiddo and Modha, FAST 2003)."""

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

__all__ = ["ARCPolicy"]

_Queue = OrderedDict[Hashable, None]  # least recently used first


@POLICIES.register("arc")
class ARCPolicy:
    """Adaptive Replacement Cache.

    Resident keys are split into ``T1`` (seen once recently) and ``T2`` (seen at least
    twice); the ghost lists ``B1`` and ``B2`` remember keys recently evicted from each,
    without data. A miss that hits ``B1`` grows the target size ``p`` of ``T1``, one
    that hits ``B2`` shrinks it, so the split follows the workload. Ghost hits are
    admitted straight into ``T2``. ``|T1| + |B1| <= capacity`` and all four lists
    together hold at most ``2 * capacity`` keys.

    When the preferred list has only protected keys, the victim comes from the other;
    discarded keys are dropped from the ghost lists too.

    Parameters
    ----------
    capacity : int
        Most keys resident at once, >= 1.

    Examples
    --------
    >>> p = ARCPolicy(2)
    >>> p.admit("a"), p.admit("b")
    ([], [])
    >>> p.touch("a")
    >>> p.admit("c")  # "b" is remembered in B1
    ['b']
    >>> p.admit("b")  # a ghost hit grows T1's target, so T2 gives up "a"
    ['a']
    >>> p.keys()
    ['c', 'b']
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_capacity(capacity)
        self._t1: _Queue = OrderedDict()
        self._t2: _Queue = OrderedDict()
        self._b1: _Queue = OrderedDict()
        self._b2: _Queue = OrderedDict()
        self._p = 0.0  # target size of T1

    @property
    def capacity(self) -> int:
        """Most keys resident at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def touch(self, key: Hashable) -> None:
        """Move ``key`` to the most recent end of ``T2``."""
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        else:
            raise not_resident(key)

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Insert ``key`` (into ``T2`` after a ghost hit, else ``T1``), evicting if full."""
        check_absent(self, key)
        c, t1, t2, b1, b2 = self._capacity, self._t1, self._t2, self._b1, self._b2
        is_full = len(self) >= c
        if is_full:
            first_unprotected(chain(t1, t2), protected, key)  # fail before changing anything
        evicted = []
        if key in b1:  # recency was undervalued: grow T1's target
            self._p = min(c, self._p + max(len(b2) / len(b1), 1.0))
            if is_full:
                evicted.append(self._replace(False, protected, key))
            del b1[key]
            t2[key] = None
            return evicted
        if key in b2:  # frequency was undervalued: shrink T1's target
            self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
            if is_full:
                evicted.append(self._replace(True, protected, key))
            del b2[key]
            t2[key] = None
            return evicted
        if len(t1) + len(b1) >= c:
            if len(t1) < c:
                b1.popitem(last=False)
                if is_full:
                    evicted.append(self._replace(False, protected, key))
            else:  # T1 fills the cache and B1 is empty: evict from T1 without a ghost
                victim = first_unprotected(t1, protected, key)
                del t1[victim]
                evicted.append(victim)
        elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
            if len(t1) + len(t2) + len(b1) + len(b2) >= 2 * c:
                b2.popitem(last=False)
            if is_full:
                evicted.append(self._replace(False, protected, key))
        t1[key] = None
        return evicted

    def discard(self, key: Hashable) -> None:
        """Forget ``key``, resident or ghost."""
        for queue in (self._t1, self._t2, self._b1, self._b2):
            queue.pop(key, None)

    def keys(self) -> list[Hashable]:
        """Resident keys: ``T1`` then ``T2``, each least recent first."""
        return [*self._t1, *self._t2]

    def _replace(self, is_b2_hit: bool, protected: Container[Hashable], key: Hashable) -> Hashable:
        """Evict the least recent unprotected key of T1 or T2 into its ghost list."""
        t1, t2 = self._t1, self._t2
        use_t1 = bool(t1) and (len(t1) > self._p or (is_b2_hit and len(t1) == self._p))
        source = t1 if use_t1 else t2
        if all(k in protected for k in source):
            source = t2 if use_t1 else t1
        victim = first_unprotected(source, protected, key)
        del source[victim]
        (self._b1 if source is t1 else self._b2)[victim] = None
        return victim
