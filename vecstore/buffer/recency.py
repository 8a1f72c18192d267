"""LRU and FIFO victim lists for every row of a block cache at once (Numba, no Python loop).

A row's victim list is its slots from the one to evict first to the last: free slots (never
admitted) first, in slot order, then the others by last use (LRU: an admission or a hit) or
by admission (FIFO). A step moves the slots it used to the end, in the order the step used
them, and leaves the rest in place: what :class:`~vecstore.policies.LRUPolicy` and
:class:`~vecstore.policies.FIFOPolicy` fed the same record cluster by cluster would publish, at
the cost of one compiled pass over every row's slots instead of a Python call per retrieved
cluster. The pass releases the GIL, so the policy worker does not hold up the thread that
launches the decode steps.
"""

from __future__ import annotations

import numba
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
        self._deferred: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def defer(self, slot: np.ndarray, admitted: np.ndarray, count: np.ndarray) -> None:
        """Keep one step for the next :meth:`apply`, which folds it in with its own, as if
        each had been applied in turn: a worker behind the decode loop folds its queue once,
        not each record over every slot (arguments as :meth:`apply`'s; copied)."""
        self._deferred.append(_used(slot, admitted, count))

    def apply(self, slot: np.ndarray, admitted: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Fold one step in (after the steps :meth:`defer` kept) and return the
        ``[rows, num_slots]`` int32 victim list.

        ``slot`` and ``admitted`` are the step record's ``[rows, R]`` hit and admission
        slots (-1: none), of which the first ``count[row]`` are valid. A slot is used at
        most once a step (admissions go to slots no hit of the step holds).
        """
        parts = [*self._deferred, _used(slot, admitted, count)]
        self._deferred = []
        hit, adm, valid = (np.concatenate([p[i] for p in parts], axis=1) for i in range(3))
        out = np.empty_like(self._order)
        _fold(self._order, hit, adm, valid, self._touch_hits, out)
        self._order = out
        return out.copy()


def _used(slot: np.ndarray, admitted: np.ndarray, count: np.ndarray,
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step's hit and admission slots (copies) and which of them are valid."""
    valid = np.arange(slot.shape[1])[None, :] < np.asarray(count)[:, None]
    return np.array(slot, dtype=np.int32), np.array(admitted, dtype=np.int32), valid


@numba.njit(cache=True, nogil=True)
def _fold(order, slot, admitted, valid, touch_hits, out):
    # per row: the order without the slots the steps used, then those slots by their last
    # use (the steps' entries in step order; admissions, with touch_hits also hits): what
    # folding the steps one by one gives. The keep loop writes every slot and advances only
    # past those kept (no branch: 0.31 against 0.64 ms at 32 rows x 3,277 slots); the slots
    # written past the kept ones are overwritten by the used ones
    rows, num_slots = order.shape
    width = slot.shape[1]
    last = np.empty(num_slots, dtype=np.int64)
    for r in range(rows):
        src, hit, adm, ok, dst = order[r], slot[r], admitted[r], valid[r], out[r]
        last[:] = -1
        for i in range(width):
            u = adm[i] if hit[i] < 0 else (hit[i] if touch_hits else -1)
            if ok[i] and 0 <= u < num_slots:
                last[u] = i
        j = 0
        for p in range(num_slots):
            dst[j] = src[p]
            j += last[src[p]] < 0
        for i in range(width):
            u = adm[i] if hit[i] < 0 else (hit[i] if touch_hits else -1)
            if ok[i] and 0 <= u < num_slots and last[u] == i:
                dst[j] = u
                j += 1
