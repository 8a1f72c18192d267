"""Many sequences queried as one batch: stacked steady zones and cached stacked views."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vecstore.engine.layer_state import LayerState
from vecstore.engine.sequence import Sequence
from vecstore.engine.shared_tail import gather, holds
from vecstore.executor.base import Steady
from vecstore.index.base import IndexView
from vecstore.kvstore.base import MemoryAccount, shape_bytes
from vecstore.kvstore.placement import Placement

__all__ = ["BatchViews", "stack_steady", "empty_view"]


class BatchViews:
    """The stacked index view of the last batch queried per layer, reused while none of
    its sequences' segments change (decode steps query the same batch every layer).

    A stack is a second copy of the batch's rows and index metadata. Its bytes are charged
    to the store's budgets before it is built (rows to their tier's account, metadata to
    the device's ``kvstore.gpu_budget_gb``) and returned when it is replaced or cleared;
    when they do not fit, :meth:`view` raises :class:`~vecstore.errors.CapacityError` and
    builds nothing. When every row is equally long and sits in device memory, the sequences
    then read their rows from the stack (:meth:`vecstore.engine.layer_state.LayerState.share_rows`,
    which keeps their own charge), so the batch holds one copy of its rows and the stack's
    charge for them is returned at once. Stacked views replaced or cleared are handed
    out by :meth:`take_retired` (so an executor can free what it prepared for them).

    Parameters
    ----------
    placement : Placement, optional
        The store's tiers and accounts: rows are charged to the tier's account of the
        layer's device, metadata to the device's; without it nothing is charged.
    """

    def __init__(self, placement: Placement | None = None) -> None:
        self._placement = placement
        self._cache: dict[int, _Stacked] = {}
        self._retired: list[IndexView] = []

    def take_retired(self) -> list[IndexView]:
        """The stacked views replaced or cleared since the last call."""
        retired, self._retired = self._retired, []
        return retired

    def clear(self) -> None:
        """Retire every stacked view and return its charges."""
        for layer in list(self._cache):
            self._drop(layer)

    def view(self, seqs: list[Sequence], layer: int) -> IndexView | None:
        """The ``B = len(seqs)`` view of ``layer`` (``None`` if no sequence has segments).

        Raises
        ------
        CapacityError
            A new stack does not fit the budgets (nothing is built or charged).
        """
        if len(seqs) == 1:
            return seqs[0].layers[layer].view()
        key = tuple((id(s), s.layers[layer].version) for s in seqs)
        cached = self._cache.get(layer)
        if cached is not None and cached.key == key:
            return cached.view
        self._drop(layer)  # the old stack goes before the new one is charged and built
        views = [s.layers[layer].view() for s in seqs]
        present = [v for v in views if v is not None]
        if not present:
            self._cache[layer] = _Stacked(key, None, [])
            return None
        rows = [v if v is not None else empty_view(present[0]) for v in views]
        charges = self._charge(seqs[0].layers[layer].device, rows)
        try:
            batch = IndexView.stack(rows)
        except BaseException:
            _release(charges)
            raise
        # rows all of one length are unpadded in the stack: each sequence reads its rows
        # from there and its own copy is freed (one copy of the batch's KV, not two). Only
        # when all are: a row left on an older stack would keep all of it alive
        if all(v is not None and v.keys.shape == present[0].keys.shape for v in views):
            shared = [s.layers[layer].share_rows(batch.keys[b], batch.values[b])
                      for b, s in enumerate(seqs)]
            if charges and all(shared):  # the sequences' own charges cover these rows now
                _release(charges[:1])
                charges = charges[1:]
        self._cache[layer] = _Stacked(key, batch, charges)
        return batch

    def _charge(self, device: torch.device,
                views: list[IndexView]) -> list[tuple[MemoryAccount, int]]:
        """Charge a stack of ``views``: ``[(rows account, bytes), (metadata account,
        bytes)]``, or raise :class:`CapacityError` having charged nothing."""
        if self._placement is None:
            return []
        rows_acct = self._placement.tier(device).account
        meta_acct = self._placement.device_account(device)
        B, n, c = len(views), max(v.keys.shape[2] for v in views), max(
            v.sizes.shape[2] for v in views)
        v0 = views[0]
        H, D = v0.keys.shape[1], v0.keys.shape[3]
        rows = shape_bytes((B, H, n, D), v0.keys.dtype)
        meta = B * H * ((c + 1) * v0.offsets.element_size() + c * v0.sizes.element_size()
                        + sum(c * math.prod(t.shape[3:]) * t.element_size()
                              for t in v0.meta.values()))
        what = f"a stacked view of {B} sequences"
        rows_acct.charge(rows, f"{what} (rows)")
        try:
            meta_acct.charge(meta, f"{what} (index metadata)")
        except BaseException:
            rows_acct.release(rows)
            raise
        return [(rows_acct, rows), (meta_acct, meta)]

    def _drop(self, layer: int) -> None:
        old = self._cache.pop(layer, None)
        if old is None:
            return
        _release(old.charges)
        if old.view is not None:
            self._retired.append(old.view)


@dataclass(frozen=True, slots=True)
class _Stacked:
    """A layer's cached stack: the batch it was built for, the view, what it charged."""

    key: tuple[tuple[int, int], ...]
    view: IndexView | None
    charges: list[tuple[MemoryAccount, int]]


def _release(charges: list[tuple[MemoryAccount, int]]) -> None:
    for account, num_bytes in charges:
        account.release(num_bytes)


def stack_steady(seqs: list[Sequence], layer: int) -> Steady:
    """The steady zones of ``layer`` of ``seqs``, zero-padded to ``[B, Hkv, S, D]``.

    Never waits for the device: rows whose sinks are full and whose tails are equally long
    share a :class:`~vecstore.engine.tail.TailBuffer` (gathered into one at their first query),
    which is the steady zone as it is (``S`` is its capacity, the lengths say how much is
    filled, ``persistent``); other rows are zero-padded, their lengths copied from (pinned)
    host memory, asynchronously.
    """
    states = [s.layers[layer] for s in seqs]
    dev = states[0].device
    if _same_shapes(states) and len({id(st) for st in states}) == len(states):
        n = states[0].pending_keys.shape[1]
        a = states[0].config.attention
        tail = states[0].tail_buffer
        if tail is None or not holds(tail, states, n):
            # the rows' steady zones move into one buffer (once) if their sinks are full:
            # later queries and decode appends use it in place
            full = states[0].sink_keys.shape[1] == a.sink_tokens
            tail = gather(states, max(a.window_tokens + a.update_tokens, n)) if full else None
        if tail is not None:
            return Steady(tail.keys, tail.values, tail.lengths(n), True)
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
