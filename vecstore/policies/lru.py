"""LRU: evict the key whose last use is the oldest."""

from __future__ import annotations

from collections.abc import Hashable

from vecstore.policies.base import POLICIES, QueuePolicy

__all__ = ["LRUPolicy"]


@POLICIES.register("lru")
class LRUPolicy(QueuePolicy):
    """Least recently used: admission and every hit count as a use (the queue runs from
    least to most recently used).

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

    def _hit(self, key: Hashable) -> None:
        self._queue.move_to_end(key)
