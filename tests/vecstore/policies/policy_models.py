"""Reference replacement policies, written from each policy's definition rather than its
data structure; ``test_policies.py`` checks every policy against them."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any


class RefLRU:
    """Evict the unprotected key with the oldest last use (admission or hit)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.clock, self.last = capacity, 0, {}

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, key: Hashable) -> None:
        self.last[key] = self._tick()

    def admit(self, key: Hashable, protected: Iterable[Hashable]) -> list[Hashable]:
        evicted = []
        if len(self.last) >= self.capacity:
            victim = min((k for k in self.last if k not in protected), key=self.rank)
            del self.last[victim]
            evicted.append(victim)
        self.last[key] = self._tick()
        return evicted

    def discard(self, key: Hashable) -> None:
        self.last.pop(key, None)

    def rank(self, key: Hashable) -> Any:
        return self.last[key]

    def keys(self) -> list[Hashable]:
        return sorted(self.last, key=self.rank)


class RefFIFO(RefLRU):
    """Evict the unprotected key admitted the longest ago."""

    def touch(self, key: Hashable) -> None:
        pass


class RefLFU(RefLRU):
    """Evict the unprotected key with the fewest uses, then the oldest last use."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.uses: dict[Hashable, int] = {}

    def touch(self, key: Hashable) -> None:
        self.uses[key] += 1
        super().touch(key)

    def admit(self, key: Hashable, protected: Iterable[Hashable]) -> list[Hashable]:
        evicted = super().admit(key, protected)
        for k in evicted:
            del self.uses[k]
        self.uses[key] = 1
        return evicted

    def discard(self, key: Hashable) -> None:
        super().discard(key)
        self.uses.pop(key, None)

    def rank(self, key: Hashable) -> Any:
        return (self.uses[key], self.last[key])


class RefClock:
    """A ring of [key, bit] with a hand; new keys go just behind the hand."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.ring, self.hand = capacity, [], 0

    def touch(self, key: Hashable) -> None:
        next(e for e in self.ring if e[0] == key)[1] = True

    def admit(self, key: Hashable, protected: Iterable[Hashable]) -> list[Hashable]:
        if len(self.ring) < self.capacity:
            self.ring.insert(self.hand, [key, False])
            self.hand += 1
            return []
        while True:
            self.hand %= len(self.ring)
            entry = self.ring[self.hand]
            if entry[0] in protected:
                self.hand += 1
            elif entry[1]:
                entry[1] = False
                self.hand += 1
            else:
                victim, entry[:] = entry[0], [key, False]
                self.hand += 1
                return [victim]

    def discard(self, key: Hashable) -> None:
        for i, entry in enumerate(self.ring):
            if entry[0] == key:
                del self.ring[i]
                self.hand -= i < self.hand
                return

    def keys(self) -> list[Hashable]:
        h = self.hand % len(self.ring) if self.ring else 0
        return [e[0] for e in self.ring[h:] + self.ring[:h]]


class RefARC:
    """Figure 4 of Megiddo and Modha (FAST 2003) on plain lists, least recent first.

    With nothing protected or discarded it is the paper's algorithm; protected keys
    are passed over (from the other list if need be), discards leave every list, and
    REPLACE runs only when the cache is full (always so in the paper).
    """

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: list = []
        self.t2: list = []
        self.b1: list = []
        self.b2: list = []

    def _replace(self, x: Hashable, protected: Iterable[Hashable]) -> Hashable:
        use_t1 = self.t1 and (len(self.t1) > self.p or (x in self.b2 and len(self.t1) == self.p))
        lists = [(self.t1, self.b1), (self.t2, self.b2)]
        for t, b in lists if use_t1 else lists[::-1]:
            free = [k for k in t if k not in protected]
            if free:
                t.remove(free[0])
                b.append(free[0])
                return free[0]
        raise AssertionError("no victim")

    def touch(self, x: Hashable) -> None:
        (self.t1 if x in self.t1 else self.t2).remove(x)
        self.t2.append(x)

    def admit(self, x: Hashable, protected: Iterable[Hashable]) -> list[Hashable]:
        c, t1, t2, b1, b2 = self.c, self.t1, self.t2, self.b1, self.b2
        is_full = len(t1) + len(t2) == c
        evicted = []
        if x in b1 or x in b2:
            if x in b1:
                self.p = min(c, self.p + max(len(b2) / len(b1), 1))
            else:
                self.p = max(0, self.p - max(len(b1) / len(b2), 1))
            if is_full:
                evicted = [self._replace(x, protected)]
            (b1 if x in b1 else b2).remove(x)
            t2.append(x)
            return evicted
        total = len(t1) + len(t2) + len(b1) + len(b2)
        if len(t1) + len(b1) == c:
            if len(t1) < c:
                b1.pop(0)
                if is_full:
                    evicted = [self._replace(x, protected)]
            else:
                evicted = [next(k for k in t1 if k not in protected)]
                t1.remove(evicted[0])
        elif total >= c:
            if total == 2 * c:
                b2.pop(0)
            if is_full:
                evicted = [self._replace(x, protected)]
        t1.append(x)
        return evicted

    def discard(self, x: Hashable) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            if x in lst:
                lst.remove(x)

    def keys(self) -> list[Hashable]:
        return self.t1 + self.t2


class RefS3FIFO:
    """S3-FIFO as documented (one eviction per admission) on plain lists, oldest first.

    With nothing protected or discarded it is the paper's Algorithm 1 except that a
    promotion which evicts from M ends the eviction; protected keys passed go to the tail.
    """

    def __init__(self, c: int) -> None:
        self.c, self.s_cap = c, max(1, c // 10)
        self.m_cap = c - self.s_cap
        self.small: list = []  # [key, count]
        self.main: list = []
        self.ghost: list = []

    def touch(self, x: Hashable) -> None:
        entry = next(e for e in self.small + self.main if e[0] == x)
        entry[1] = min(entry[1] + 1, 3)

    def admit(self, x: Hashable, protected: Iterable[Hashable]) -> list[Hashable]:
        is_full = len(self.small) + len(self.main) >= self.c
        evicted = [self._evict(protected)] if is_full else []
        if x in self.ghost:
            self.ghost.remove(x)
            self.main.append([x, 0])
        else:
            self.small.append([x, 0])
        return evicted

    def _evict(self, protected: Iterable[Hashable]) -> Hashable:
        main_has_victim = any(k not in protected for k, _ in self.main)
        if len(self.small) >= self.s_cap or not main_has_victim:
            for _ in range(len(self.small)):
                key, count = self.small.pop(0)
                if key in protected:
                    self.small.append([key, count])
                elif count > 0:
                    self.main.append([key, 0])
                    if len(self.main) > self.m_cap:
                        return self._evict_main(protected)
                else:
                    self.ghost = (self.ghost + [key])[-self.m_cap:] if self.m_cap else []
                    return key
        return self._evict_main(protected)

    def _evict_main(self, protected: Iterable[Hashable]) -> Hashable:
        while True:
            key, count = self.main.pop(0)
            if key in protected:
                self.main.append([key, count])
            elif count == 0:
                return key
            else:
                self.main.append([key, count - 1])

    def discard(self, x: Hashable) -> None:
        self.small = [e for e in self.small if e[0] != x]
        self.main = [e for e in self.main if e[0] != x]
        self.ghost = [k for k in self.ghost if k != x]

    def keys(self) -> list[Hashable]:
        return [e[0] for e in self.small + self.main]
