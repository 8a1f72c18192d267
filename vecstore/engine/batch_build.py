"""A batch's new segments built together: one :meth:`Index.build` for the rows of a layer.

The rows of a batch prefilled in step reach a segment boundary at the same chunk: building
each row's segment on its own launches the index build's small kernels once per row
(k-means iterations over ``Hkv`` problems each), building them together once for all
``B x Hkv`` problems. Every index builds each head on its own
(:meth:`~vecstore.index.base.Index.build`), so the rows' segments are the stacked build's,
sliced back by head.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from vecstore.engine.layer_staging import StagedAppend
from vecstore.engine.layer_state import LayerState
from vecstore.index.base import Segment
from vecstore.kvstore.row_transfer import host_writes_together

__all__ = ["build_together", "commit_together"]


def build_together(states: list[LayerState], staged: list[StagedAppend]) -> list[list[Segment]]:
    """The segments indexing each staged append's ready tokens
    (:meth:`LayerState.build <vecstore.engine.layer_state.LayerState.build>` of each):
    appends that share an index, a device and a number of ready tokens in one build.

    Examples
    --------
    >>> from vecstore import Store
    >>> config = {"index": {"segment_tokens": 64},
    ...           "attention": {"sink_tokens": 4, "window_tokens": 16, "update_tokens": 64}}
    >>> with Store.open(config=config) as store:
    ...     seqs = [store.create(n, num_layers=1, num_kv_heads=2, head_dim=8,
    ...                          dtype=torch.float32) for n in "ab"]
    ...     states = [s.layers[0] for s in seqs]
    ...     staged = [st.stage(torch.randn(2, 300, 8), torch.randn(2, 300, 8),
    ...                        whole_segments=True) for st in states]
    ...     built = build_together(states, staged)
    >>> [[(g.start, g.end, tuple(g.keys.shape)) for g in row] for row in built][1]
    [(4, 68, (2, 64, 8)), (68, 132, (2, 64, 8)), (132, 196, (2, 64, 8)), (196, 260, (2, 64, 8))]
    """
    built: list[list[Segment]] = [[] for _ in staged]
    together: dict[tuple, list[int]] = defaultdict(list)
    for i, (state, st) in enumerate(zip(states, staged, strict=True)):
        if st.ready:
            together[(id(state.index), st.ready, st.pending_keys.device,
                      st.pending_keys.shape[0])].append(i)
    for members in together.values():
        if len(members) == 1:
            built[members[0]] = states[members[0]].build(staged[members[0]])
            continue
        parts = [staged[i].ready_tokens() for i in members]
        keys = torch.cat([k for k, _ in parts])
        values = torch.cat([v for _, v in parts])
        segments = states[members[0]].index.build(keys, values, 0)
        H = parts[0][0].shape[0]
        for j, i in enumerate(members):
            built[i] = [_heads_of(s, slice(j * H, (j + 1) * H), staged[i].start)
                        for s in segments]
    return built


def commit_together(states: list[LayerState], staged: list[StagedAppend]) -> None:
    """Build the staged appends' segments together (:func:`build_together`), then commit
    each to its layer, in order, their rows in host memory on return; a placement that
    does not fit raises :class:`~vecstore.errors.CapacityError` with the layers before it
    committed (the store's transaction rolls them back)."""
    built = build_together(states, staged)
    # rows copied into host memory are waited for once, after the last layer's placement:
    # placing a layer (registering pinned pages) overlaps the copies before it
    with host_writes_together():
        for state, st, new in zip(states, staged, built, strict=True):
            state.commit(st, new)


def _heads_of(segment: Segment, heads: slice, start: int) -> Segment:
    """The heads ``heads`` of a stacked build's ``segment``, its positions moved by
    ``start``."""
    return Segment(segment.start + start, segment.end + start, segment.keys[heads],
                   segment.values[heads], segment.offsets[heads],
                   {k: v[heads] for k, v in segment.meta.items()})
