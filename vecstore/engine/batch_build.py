"""A batch's new segments built together: one :meth:`Index.build` for the rows of a layer.

The rows of a batch prefilled in step reach a segment boundary at the same chunk: building
each row's segment on its own launches the index build's small kernels once per row
(k-means iterations over ``Hkv`` problems each), building them together once for all
``B x Hkv`` problems. Every index builds each head on its own
(:meth:`~vecstore.index.base.Index.build`), so the rows' segments are the stacked build's,
sliced back by head. Their first placement is made together too: one stack of the tier, a
batch row each (:func:`stacked_first_rows`), which the batch's queries then read as it is.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from vecstore.engine.layer_staging import StagedAppend
from vecstore.engine.layer_state import LayerState
from vecstore.index.base import Segment
from vecstore.kvstore.base import StoredRows, growable_rows
from vecstore.kvstore.row_transfer import host_writes_together

__all__ = ["build_together", "commit_together", "stacked_first_rows"]


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
    committed (the store's transaction rolls them back).

    A batch's first placement (every layer places its first segments now, all as many
    rows, in a tier that shares rows) goes into one stack of the tier, each layer taking
    its batch row (:func:`stacked_first_rows`): the batch's stacked view is then those rows
    as they are (:func:`~vecstore.engine.batch_share.stacked_rows`), not a copy of them."""
    built = build_together(states, staged)
    parts = stacked_first_rows(states, built)
    taken = 0
    try:
        # rows copied into host memory are waited for once, after the last layer's
        # placement: placing a layer (registering pinned pages) overlaps the copies before it
        with host_writes_together():
            for state, st, new, rows in zip(states, staged, built, parts, strict=True):
                state.commit(st, new, rows)
                taken += 1
    except BaseException:
        left = [rows for rows in parts[taken:] if rows is not None]
        if left:  # the stack's rows no layer took go back
            placement = states[0].placement
            assert placement is not None
            for rows in left:
                placement.tier(states[0].device).free(rows)
        raise


def stacked_first_rows(states: list[LayerState],
                       built: list[list[Segment]]) -> list[StoredRows | None]:
    """Rows for a batch's first placement, one stack of the tier split into its batch rows
    (:func:`~vecstore.kvstore.base.growable_rows`, :meth:`KVStore.split
    <vecstore.kvstore.base.KVStore.split>`: charged now, each row its part), when every
    layer of ``states`` places its first segments (``built``), all as many rows, on one
    device whose tier shares rows; ``None`` for each otherwise.

    Raises
    ------
    CapacityError
        The stack does not fit in the tier's budget; nothing is charged.
    """
    none: list[StoredRows | None] = [None] * len(states)
    first = states[0]
    placement = first.placement
    if len(states) < 2 or placement is None or not all(built):
        return none
    n = {sum(s.num_tokens for s in new) for new in built}
    heads = {(new[0].keys.shape[0], new[0].keys.shape[2]) for new in built}
    if len(n) != 1 or len(heads) != 1 or any(
            st.placement is not placement or st.device != first.device or st.segments
            or st.rows is not None for st in states):
        return none
    tier = placement.tier(first.device)
    if not type(tier).shareable_rows:
        return none
    (H, D), (N,) = heads.pop(), n
    # reserved as a layer's own rows were when they first grew, by a segment: a 128K
    # prompt indexed in 8K segments stays in its first reserve through its decoding's
    # first flushes (a reserve for 16 x 8K rows alone moved all of it at the first)
    stack = growable_rows(tier, (len(states), H, N, D), first.dtype,
                          f"the rows of a batch of {len(states)} sequences ({N} tokens each)",
                          room=N + first.config.index.segment_tokens)
    return list(tier.split(stack))


def _heads_of(segment: Segment, heads: slice, start: int) -> Segment:
    """The heads ``heads`` of a stacked build's ``segment``, its positions moved by
    ``start``."""
    return Segment(segment.start + start, segment.end + start, segment.keys[heads],
                   segment.values[heads], segment.offsets[heads],
                   {k: v[heads] for k, v in segment.meta.items()})
