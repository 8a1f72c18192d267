"""LRU and FIFO victim lists for every row of a block cache at once (numpy, no Python loop).

A row's victim list is its slots from the one to evict first to the last: free slots (never
admitted) first, in slot order, then the others by last use (LRU: an admission or a hit) or
by admission (FIFO). A step moves the slots it used to the end, in the order the step used
them, and leaves the rest in place: what :class:`~vecstore.cache.LRUPolicy` and
:class:`~vecstore.cache.FIFOPolicy` fed the same record cluster by cluster would publish, at
the cost of a few array operations over all rows instead of a Python call per retrieved
cluster.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RECENCY", "RecencyOrder"]

RECENCY = {"lru": True, "fifo": False}
"""Policies kept as one order of slots, and whether a hit moves its slot to the end."""


class RecencyOrder:
    """The victim lists of ``rows`` caches of ``num_slots`` slots under ``policy``.

    Examples
    --------
    >>> order = RecencyOrder(1, 3, "lru")
    >>> i32 = lambda *v: np.array([v], dtype=np.int32)
    >>> order.apply(i32(-1, -1), i32(0, 1), np.array([2])).tolist()  # two misses admitted
    [[2, 0, 1]]
    >>> order.apply(i32(0), i32(-1), np.array([1])).tolist()  # a hit on slot 0
    [[2, 1, 0]]
    """

    def __init__(self, rows: int, num_slots: int, policy: str) -> None:
        self._touch_hits = RECENCY[policy]
        self._order = np.tile(np.arange(num_slots, dtype=np.int32), (rows, 1))

    def apply(self, slot: np.ndarray, admitted: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Fold one step in and return the ``[rows, num_slots]`` int32 victim list.

        ``slot`` and ``admitted`` are the step record's ``[rows, R]`` hit and admission
        slots (-1: none), of which the first ``count[row]`` are valid. A slot is used at
        most once a step (admissions go to slots no hit of the step holds).
        """
        rows, width = slot.shape
        valid = np.arange(width)[None, :] < count[:, None]
        used = np.where(valid & (slot < 0), admitted, -1)
        if self._touch_hits:
            used = np.where(valid & (slot >= 0), slot, used)
        moved = np.zeros(self._order.shape, dtype=bool)
        r, p = np.nonzero(used >= 0)
        moved[r, used[r, p]] = True
        keep = ~np.take_along_axis(moved, self._order, axis=1)
        # each row keeps num_slots - k slots and moves k: row-major selection, same width
        picked = np.concatenate([self._order, used], axis=1)[
            np.concatenate([keep, used >= 0], axis=1)]
        self._order = picked.reshape(self._order.shape).astype(np.int32, copy=False)
        return self._order.copy()
