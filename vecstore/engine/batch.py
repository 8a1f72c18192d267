"""Many sequences queried as one batch: their cached stacked index views (the steady
zones: :mod:`vecstore.engine.batch_steady`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from vecstore.engine.batch_share import grown_rows, share, stacked_rows
from vecstore.engine.layer_state import LayerState
from vecstore.engine.sequence import Sequence
from vecstore.engine.view_turnover import ViewTurnover
from vecstore.errors import CapacityError
from vecstore.index.base import IndexView
from vecstore.kvstore.base import KVStore, MemoryAccount, StoredRows, growable_rows
from vecstore.kvstore.placement import Placement

__all__ = ["BatchViews", "empty_view"]


class BatchViews:
    """The stacked index view of the last batch queried per layer, reused while none of
    its sequences' segments change (decode steps query the same batch every layer).

    A stack's rows are placed through the tier of the layer's device
    (:func:`~vecstore.kvstore.base.growable_rows`, charging the tier's account: rows of the
    ``pinned`` tier go straight into page-locked memory of the tier's own) and its metadata
    is charged to the device's ``kvstore.gpu_budget_gb``, before anything is copied; both
    are returned when the stack is replaced or cleared. When they do not fit, :meth:`view`
    raises :class:`~vecstore.errors.CapacityError` and builds nothing.

    When every row is equally long, the sequences then share the stack's rows
    (:func:`~vecstore.engine.batch_share.share`): each layer reads its batch row of the
    stack and frees its own copy, so the batch holds one copy of its KV. While each row
    only gains segments (the same sequences in the same order, each layer's lineage
    unchanged, :mod:`~vecstore.engine.layer_lineage`; all again equally long: a decode step
    that indexed the tails), the stack grows instead of being rebuilt: shared rows that
    their layers grew in place (the ``pinned`` tier's reserve had room) are viewed anew,
    copying nothing; rows of the stack's own the tier extends
    (:meth:`~vecstore.kvstore.base.KVStore.extend`) and only the new rows are copied in.
    The metadata is stacked anew (a small device copy). Anything else (a padded stack, a
    rollback, another batch, a row moved out of the stack, growth that does not fit)
    rebuilds it. Stacked views replaced (grown or rebuilt) or cleared are handed out by
    ``turnover`` (:class:`~vecstore.engine.view_turnover.ViewTurnover`; so an executor can
    free what it prepared for them; a grown view's rows are the old view's, extended, and
    it succeeds the old one).

    Parameters
    ----------
    placement : Placement, optional
        The store's tiers and accounts; without it the rows are concatenated and nothing
        is charged.
    """

    def __init__(self, placement: Placement | None = None) -> None:
        self._placement = placement
        self._cache: dict[int, _Stacked] = {}
        self.turnover = ViewTurnover()

    def clear(self) -> None:
        """Retire every stacked view and return its charges."""
        for layer in list(self._cache):
            self._drop(layer)

    def view(self, seqs: list[Sequence], layer: int) -> IndexView | None:
        """The ``B = len(seqs)`` view of ``layer`` (``None`` if no sequence has segments).

        Raises
        ------
        CapacityError
            A new stack does not fit the budgets (nothing is built or charged; the old
            stack of the layer is gone).
        """
        if len(seqs) == 1:
            return seqs[0].layers[layer].view()
        states = [s.layers[layer] for s in seqs]
        key = tuple((id(s), st.version) for s, st in zip(seqs, states, strict=True))
        cached = self._cache.get(layer)
        if cached is not None and cached.key == key:
            return cached.view
        if (cached is not None and self._grows(cached, states)
                and self._grow(layer, cached, states, key)):
            return self._cache[layer].view
        self._drop(layer)  # the old stack goes before the new one is charged and built
        views = [st.view() for st in states]
        present = [v for v in views if v is not None]
        if not present:
            self._cache[layer] = _Stacked(key, None)
            return None
        rows = [v if v is not None else empty_view(present[0]) for v in views]
        if self._placement is None:
            stacked = _Stacked(key, IndexView.stack(rows))
        else:
            stacked = self._build(key, states, rows)
        self._cache[layer] = stacked
        return stacked.view

    def _grows(self, old: _Stacked, states: list[LayerState]) -> bool:
        """Whether ``old`` can grow into the stack of ``states``: it holds rows of the tier
        and metadata on the device of theirs, unpadded, and each row is the one it holds
        with segments appended (same lineage), all equally long again."""
        p, dev, n = self._placement, states[0].device, states[0].num_indexed
        if (p is None or old.grows_from is None or len(old.grows_from) != len(states)
                or old.view is None or old.tier is not p.tier(dev) or old.meta is None
                or old.meta[0] is not p.device_account(dev)):
            return False
        # a lazy layer loads on reading its segments, renewing its lineage: read them first
        return n >= old.view.keys.shape[2] and all(
            len(st.segments) >= k and st.lineage == lineage and st.num_indexed == n
            for st, (lineage, k) in zip(states, old.grows_from, strict=True))

    def _grow(self, layer: int, old: _Stacked, states: list[LayerState],
              key: tuple[tuple[int, int], ...]) -> bool:
        """Grow ``old``, the stack of ``layer``, to the rows of ``states`` (:meth:`_grows`):
        over shared rows their layers grew in place, else the tier extends the stack's rows
        and only the rows added are copied; the metadata is stacked anew and its charge
        adjusted. Returns whether it did; where it cannot, nothing changed (the caller
        rebuilds)."""
        tier, views = old.tier, [st.view() for st in states]
        assert old.view is not None and old.meta is not None and tier is not None
        n_old, n = old.view.keys.shape[2], states[0].num_indexed
        account, old_meta = old.meta
        meta = _meta_bytes(views)  # >= old_meta: every row kept its units
        what = f"a stacked view of {len(views)} sequences"
        rows = None
        if old.rows is None:  # shared: viewed anew where their layers grew them in place
            grown = grown_rows(old.view, states, n)
            if grown is None or not account.can_charge(meta - old_meta):
                return False
            account.charge(meta - old_meta, f"{what} (index metadata)")
        else:
            with contextlib.suppress(CapacityError):
                account.charge(meta - old_meta, f"{what} (index metadata)")
                try:
                    rows = old.rows if n == n_old else tier.extend(
                        old.rows, n, f"{what} (rows, grown to {n} a head)")
                finally:
                    if rows is None:  # not grown: the charge goes back
                        account.release(meta - old_meta)
            if rows is None:
                return False
            grown = (rows.keys, rows.values)
        # old.rows are these rows now (grown in place, or moved by the tier), never to be
        # freed: until the copies are done, the layer's entry holds them and the new charge
        self._cache[layer] = replace(old, rows=rows, meta=(account, meta), grows_from=None)
        if rows is not None:
            for b, v in enumerate(views):
                assert v is not None and v.keys.shape[2] == n
                rows.keys[b, :, n_old:].copy_(v.keys[0, :, n_old:])
                rows.values[b, :, n_old:].copy_(v.values[0, :, n_old:])
        new = _Stacked(key, IndexView.stack(views, grown), rows, tier, (account, meta),
                       _lineages(states))
        assert old.view is not None and new.view is not None
        self.turnover.retire(old.view, successor=new.view)
        self._cache[layer] = new
        return True

    def _build(self, key: tuple[tuple[int, int], ...], states: list[LayerState],
               views: list[IndexView]) -> _Stacked:
        """A new stack of ``views`` (``B = 1`` each), its rows placed through the tier and
        zero-padded, charged before anything is copied (or :class:`CapacityError` having
        charged nothing); shared with the sequences where they can read their rows from it."""
        assert self._placement is not None
        dev = states[0].device
        tier, account = self._placement.tier(dev), self._placement.device_account(dev)
        v0 = views[0]
        B, H, D = len(views), v0.keys.shape[1], v0.keys.shape[3]
        n = max(v.keys.shape[2] for v in views)
        what = f"a stacked view of {B} sequences"
        meta = _meta_bytes(views)
        held = stacked_rows(states, n)
        if held is not None:  # the layers' rows are one stack already: viewed, not copied
            account.charge(meta, f"{what} (index metadata)")
            return _Stacked(key, IndexView.stack(views, held), None, tier, (account, meta),
                            _lineages(states))
        rows = growable_rows(tier, (B, H, n, D), v0.keys.dtype, f"{what} (rows)")
        try:
            account.charge(meta, f"{what} (index metadata)")
        except BaseException:
            tier.free(rows)
            raise
        for b, v in enumerate(views):
            m = v.keys.shape[2]
            for dst, src in ((rows.keys, v.keys), (rows.values, v.values)):
                dst[b, :, :m].copy_(src[0])
                dst[b, :, m:].zero_()
        batch = IndexView.stack(views, (rows.keys, rows.values))
        if any(v.keys.shape[2] != n for v in views):
            return _Stacked(key, batch, rows, tier, (account, meta))
        # rows all of one length are unpadded in the stack: the sequences share them
        shared = share(tier, rows, states)
        return _Stacked(key, batch, None if shared else rows, tier, (account, meta),
                        _lineages(states))

    def _drop(self, layer: int) -> None:
        old = self._cache.pop(layer, None)
        if old is None:
            return
        if old.rows is not None:
            assert old.tier is not None
            old.tier.free(old.rows)
        if old.meta is not None:
            old.meta[0].release(old.meta[1])
        if old.view is not None:
            self.turnover.retire(old.view)


@dataclass(frozen=True, slots=True)
class _Stacked:
    """A layer's cached stack: the batch it was built for, the view, the rows it holds in
    ``tier`` (``None``: none of its own, unplaced or shared with the sequences), its
    metadata's charge, and what it holds of each row where it may grow (``(lineage,
    segments)`` per row of an unpadded stack; ``None`` otherwise)."""

    key: tuple[tuple[int, int], ...]
    view: IndexView | None
    rows: StoredRows | None = None
    tier: KVStore | None = None
    meta: tuple[MemoryAccount, int] | None = None
    grows_from: tuple[tuple[int, int], ...] | None = None


def _lineages(states: list[LayerState]) -> tuple[tuple[int, int], ...]:
    """What a stack of ``states`` holds of each row: ``(lineage, segments)``."""
    return tuple((st.lineage, len(st.segments)) for st in states)


def _meta_bytes(views: list[IndexView]) -> int:
    """Bytes of the index metadata of ``views`` stacked (padded to the most units)."""
    B, c = len(views), max(v.sizes.shape[2] for v in views)
    v0 = views[0]
    H = v0.keys.shape[1]
    return B * H * ((c + 1) * v0.offsets.element_size() + c * v0.sizes.element_size()
                    + sum(c * math.prod(t.shape[3:]) * t.element_size()
                          for t in v0.meta.values()))


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
