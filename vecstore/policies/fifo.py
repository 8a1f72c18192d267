"""FIFO: evict the key admitted the longest ago; hits change nothing."""

from __future__ import annotations

from collections.abc import Hashable

from vecstore.policies.base import POLICIES, QueuePolicy

__all__ = ["FIFOPolicy"]


@POLICIES.register("fifo")
class FIFOPolicy(QueuePolicy):
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

    def _hit(self, key: Hashable) -> None:
        pass
