"""A batch's stacked rows shared with its sequences (:class:`~vecstore.engine.batch.BatchViews`):
each sequence's layer reads, and where the tier grows rows in place grows, its batch row of
the stack, so the batch holds one copy of its KV."""

from __future__ import annotations

import torch

from vecstore.engine.layer_state import LayerState
from vecstore.index.base import IndexView
from vecstore.kvstore.base import KVStore, StoredRows

__all__ = ["share", "grown_rows", "stacked_rows"]


def share(tier: KVStore, rows: StoredRows, states: list[LayerState]) -> bool:
    """Give each of ``states`` its batch row of ``rows`` (``[B, Hkv, N, D]``, holding
    exactly their rows) with its part of the charge (:meth:`KVStore.split`), each freeing
    its own rows; only when every one can take it (:meth:`LayerState.can_share`), so no
    row is left on an older stack keeping all of it alive. Returns whether they did; if
    not, ``rows`` are unchanged."""
    if not all(st.can_share(rows.keys[b]) for b, st in enumerate(states)):
        return False
    for st, part in zip(states, tier.split(rows), strict=True):
        st.share_rows(part)
    return True


def grown_rows(stacked: IndexView, states: list[LayerState],
               n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys and values of ``stacked`` (whose rows ``states`` share) over ``n`` rows a
    head, where each layer's rows are still its batch row of the stack, grown in place to
    ``n`` (same address and strides); ``None`` where any is not (moved out, re-placed)."""
    keys, values = stacked.keys, stacked.values
    for b, st in enumerate(states):
        rows = st.rows
        if rows is None:
            return None
        for mine, stack in ((rows.keys, keys[b]), (rows.values, values[b])):
            if (mine.data_ptr() != stack.data_ptr() or mine.stride() != stack.stride()
                    or mine.shape[1] != n):
                return None
    shape = (*keys.shape[:2], n, keys.shape[3])
    return keys.as_strided(shape, keys.stride()), values.as_strided(shape, values.stride())


def stacked_rows(states: list[LayerState],
                 n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys and values the layers ``states`` read, viewed as one ``[B, Hkv, n, D]``
    stack without a copy, where they already are one: each layer's rows are batch row ``b``
    of one allocation (a batch's first placement,
    :func:`~vecstore.engine.batch_build.commit_together`, grown in place since), evenly
    spaced, with ``n`` rows a head and the same strides; ``None`` otherwise."""
    rows = [st.rows for st in states]
    if len(rows) < 2 or any(r is None for r in rows):
        return None
    stacks = []
    for ts in ([r.keys for r in rows], [r.values for r in rows]):  # type: ignore[union-attr]
        first, size = ts[0], ts[0].element_size()
        step = ts[1].data_ptr() - first.data_ptr()
        storage = first.untyped_storage().data_ptr()
        if step <= 0 or step % size or first.shape[1] != n or any(
                t.shape != first.shape or t.stride() != first.stride()
                or t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage().data_ptr() != storage
                or t.data_ptr() != first.data_ptr() + b * step for b, t in enumerate(ts)):
            return None
        stacks.append(first.as_strided((len(ts), *first.shape),
                                       (step // size, *first.stride())))
    return stacks[0], stacks[1]
