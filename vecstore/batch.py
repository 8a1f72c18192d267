"""Many sequences queried as one batch: stacked steady zones and cached stacked views."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vecstore.executor.base import Steady
from vecstore.index.base import IndexView

if TYPE_CHECKING:
    from vecstore.layer import LayerState
    from vecstore.sequence import Sequence

__all__ = ["BatchViews", "stack_steady", "empty_view"]


class BatchViews:
    """The stacked index view of the last batch queried per layer, reused while none of
    its sequences' segments change (decode steps query the same batch every layer).

    When every row is equally long and sits in device memory, the sequences then read
    their rows from the stack (:meth:`vecstore.layer.LayerState.share_rows`), so the batch
    holds one copy of them.
    """

    def __init__(self) -> None:
        self._cache: dict[int, tuple[tuple[tuple[int, int], ...], IndexView | None]] = {}

    def clear(self) -> None:
        self._cache.clear()

    def view(self, seqs: list[Sequence], layer: int) -> IndexView | None:
        """The ``B = len(seqs)`` view of ``layer`` (``None`` if no sequence has segments)."""
        if len(seqs) == 1:
            return seqs[0].layers[layer].view()
        key = tuple((id(s), s.layers[layer].version) for s in seqs)
        cached = self._cache.get(layer)
        if cached is not None and cached[0] == key:
            return cached[1]
        views = [s.layers[layer].view() for s in seqs]
        present = [v for v in views if v is not None]
        batch = None
        if present:
            batch = IndexView.stack([v if v is not None else empty_view(present[0])
                                     for v in views])
            # rows all of one length are unpadded in the stack: each sequence reads its
            # rows from there and its own copy is freed (one copy of the batch's KV, not
            # two). Only when all are: a row left on an older stack would keep all of it
            if all(v is not None and v.keys.shape == present[0].keys.shape for v in views):
                for b, s in enumerate(seqs):
                    s.layers[layer].share_rows(batch.keys[b], batch.values[b])
        self._cache[layer] = (key, batch)
        return batch


def stack_steady(seqs: list[Sequence], layer: int) -> Steady:
    """The steady zones of ``layer`` of ``seqs``, zero-padded to ``[B, Hkv, S, D]``.

    Never waits for the device: rows of one length (a single row, or a batch without
    padding) are stacked without padding and their lengths filled on the device; only
    rows of different lengths copy their lengths from (pinned) host memory, asynchronously.
    """
    states = [s.layers[layer] for s in seqs]
    dev = states[0].device
    if len(states) > 1 and _same_shapes(states):
        # sinks and tails stacked separately: a few copies for the batch, not one per row;
        # tails in one shared buffer (vecstore.tail) are read from it as they are
        n = states[0].pending_keys.shape[1]
        tail = states[0].tail_buffer
        if tail is not None and tail.holds(states, n):
            tail_keys, tail_values = tail.keys[:, :, :n], tail.values[:, :, :n]
        else:
            tail_keys = torch.stack([st.pending_keys for st in states])
            tail_values = torch.stack([st.pending_values for st in states])
        keys = torch.cat([torch.stack([st.sink_keys for st in states]), tail_keys], dim=2)
        values = torch.cat([torch.stack([st.sink_values for st in states]), tail_values],
                           dim=2)
        return Steady(keys, values, torch.full((len(states),), keys.shape[2],
                                               dtype=torch.long, device=dev))
    parts = [st.steady() for st in states]
    sizes = [k.shape[1] for k, _ in parts]
    S = max(sizes)
    if len(parts) == 1:
        k, v = parts[0]
        return Steady(k[None], v[None], torch.full((1,), S, dtype=torch.long, device=dev))
    if min(sizes) == S:
        return Steady(torch.stack([k for k, _ in parts]), torch.stack([v for _, v in parts]),
                      torch.full((len(parts),), S, dtype=torch.long, device=dev))

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(x.shape[0], S - x.shape[1], x.shape[2])], dim=1)

    lengths = torch.tensor(sizes)
    if dev.type == "cuda":
        lengths = lengths.pin_memory().to(dev, non_blocking=True)
    else:
        lengths = lengths.to(dev)
    return Steady(torch.stack([pad(k) for k, _ in parts]),
                  torch.stack([pad(v) for _, v in parts]), lengths)


def _same_shapes(states: list[LayerState]) -> bool:
    """Whether every layer holds as many sinks, and as many tail tokens, as the first."""
    sink, tail = states[0].sink_keys.shape[1], states[0].pending_keys.shape[1]
    return all(st.sink_keys.shape[1] == sink and st.pending_keys.shape[1] == tail
               for st in states)


def empty_view(like: IndexView) -> IndexView:
    """A ``B = 1`` view with no units, shaped like ``like`` (a batch row without segments)."""
    H, D = like.keys.shape[1], like.keys.shape[3]
    dev = like.keys.device
    return IndexView(
        keys=like.keys.new_zeros(1, H, 0, D), values=like.values.new_zeros(1, H, 0, D),
        offsets=torch.zeros(1, H, 1, dtype=torch.long, device=dev),
        sizes=torch.zeros(1, H, 0, dtype=torch.long, device=dev),
        meta={k: v.new_zeros(1, H, 0, *v.shape[3:]) for k, v in like.meta.items()},
        num_units=torch.zeros(1, dtype=torch.long),
    )
