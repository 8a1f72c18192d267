"""How a store answers queries: validation, the batch's stacked views, the executor call."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from vecstore.checks import check_finite, check_index, check_tensor
from vecstore.config import LayerConfig, StoreConfig
from vecstore.engine.batch import BatchViews
from vecstore.engine.batch_steady import stack_steady
from vecstore.engine.decoder import BatchDecoder, LayerStep, flush_due
from vecstore.engine.layer_indexes import LayerIndexes
from vecstore.engine.layer_state import LayerState
from vecstore.engine.sequence import Sequence, SequenceOwner
from vecstore.errors import CapacityError, InvalidValueError, SequenceDroppedError, ShapeError
from vecstore.executor.base import Executor
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.index.base import Index, IndexView
from vecstore.kvstore.placement import Placement
from vecstore.types import QueryResult, QueryStats

__all__ = ["QueryEngine"]


class QueryEngine:
    """Validates and runs the queries of one :class:`~vecstore.engine.store.Store`.

    It stacks a batch's views (one stacked view kept per layer and charged to the budgets;
    the executor frees what it prepared for a view once it is replaced) and runs a
    multi-token query of several sequences, or a batch whose stack does not fit the
    budgets, one row at a time.

    Parameters
    ----------
    owner : SequenceOwner
        The store: only its sequences are queried.
    executor : Executor
        Runs the queries.
    config : StoreConfig
        The store's settings.
    placement : Placement
        The store's tiers and budgets.
    indexes : LayerIndexes
        The index of each layer.
    persistent : bool
        Whether the store has a directory (its steps commit: no fixed-shape decoder).
    """

    def __init__(self, owner: SequenceOwner, executor: Executor, config: StoreConfig,
                 placement: Placement, indexes: LayerIndexes, *, persistent: bool) -> None:
        self._owner = owner
        self._executor = executor
        self._config = config
        self._placement = placement
        self._indexes = indexes
        self._persistent = persistent
        self._batch_views = BatchViews(placement)
        # each layer's effective settings and index, looked up once (the config is frozen)
        self._layers: dict[int, tuple[Index, LayerConfig]] = {}

    def _layer(self, layer: int) -> tuple[Index, LayerConfig]:
        """The index and settings of ``layer``."""
        found = self._layers.get(layer)
        if found is None:
            found = self._layers[layer] = (self._indexes.index(layer),
                                           self._config.for_layer(layer))
        return found

    def check(self, seqs: list[Sequence], layer: int, q: object, scale: float | None, *,
              finite: bool = True, grouped: bool = True) -> tuple[torch.Tensor, float]:
        """:meth:`Store.check_query <vecstore.engine.store.Store.check_query>`."""
        self.check_seqs(seqs, layer, stored=True)
        first = seqs[0]
        H, D = first.num_kv_heads, first.head_dim
        check_tensor(q, "q", shape=(len(seqs), None, None, D), dtype=first.dtype)
        assert isinstance(q, torch.Tensor)
        B, Hq, L, _ = q.shape
        if Hq == 0 or Hq % H or L == 0:
            raise ShapeError(f"q: expected (B, Hq, L, {D}) with Hq a positive multiple of the "
                             f"{H} KV heads and L >= 1, got {tuple(q.shape)}")
        if finite:
            check_finite(q, "q")
        if scale is None:
            scale = 1.0 / math.sqrt(D)
        elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise InvalidValueError(f"scale: expected a positive finite number, got {scale!r}")
        if not grouped:
            return q, float(scale)
        q = q.to(first.layers[layer].device)
        return q.float().reshape(B, H, Hq // H, L, D), float(scale)

    def check_seqs(self, seqs: object, layer: int, *, stored: bool) -> None:
        """Check that ``seqs`` is a non-empty list of live sequences of the store whose
        ``layer`` exists and agrees in KV heads, head_dim, dtype and device (and, with
        ``stored``, holds tokens in every row). The caller checked that the store is
        open."""
        if not isinstance(seqs, (list, tuple)) or not seqs:
            raise InvalidValueError("seqs: expected a non-empty list of Sequence")
        first = seqs[0]
        for s in seqs:
            if not isinstance(s, Sequence) or s.owner is not self._owner:
                raise InvalidValueError("seqs: every item must be a Sequence of this store")
            if s.is_dropped:
                raise SequenceDroppedError(f"sequence {s.name!r} was dropped")
            check_index(layer, "layer", s.num_layers)
            here, there = s.layers[layer].device, first.layers[layer].device
            if (s.num_kv_heads, s.head_dim, s.dtype, here) != (
                    first.num_kv_heads, first.head_dim, first.dtype, there):
                raise InvalidValueError(
                    f"seqs: {s.name!r} and {first.name!r} differ in KV heads, head_dim, "
                    "dtype or device and cannot be used together")
            if stored and s.layers[layer].num_tokens == 0:
                raise InvalidValueError(f"layer {layer} of sequence {s.name!r} holds no tokens")

    def run(self, seqs: list[Sequence], layer: int, q: torch.Tensor,
            scale: float, softcap: float | None = None) -> QueryResult:
        """Answer a query :meth:`check` accepted (``softcap`` checked by the caller)."""
        q = q.to(seqs[0].layers[layer].device)
        if len(seqs) > 1 and q.shape[2] > 1:
            return self._run_rows(seqs, layer, q, scale, softcap)
        try:
            view = self._batch_views.view(seqs, layer)
        except CapacityError:
            if len(seqs) == 1:
                raise
            # no room for a stacked copy of the batch: each row reads its own view
            return self._run_rows(seqs, layer, q, scale, softcap)
        finally:
            self.retire_replaced([s.layers[layer] for s in seqs])
        steady = stack_steady(seqs, layer)
        index, config = self._layer(layer)
        out, lse, stats = self._executor.run(index, view, steady, q, scale, config,
                                             softcap=softcap)
        return QueryResult(out=out, lse=lse, stats=stats)

    def _run_rows(self, seqs: list[Sequence], layer: int, q: torch.Tensor,
                  scale: float, softcap: float | None) -> QueryResult:
        """A multi-token query (a prefill chunk) of several sequences, or a batch whose
        stacked view does not fit the budgets, one row at a time.

        Each row reads its own layer's view in place, so the batch never stacks a padded
        ``[B, Hkv, N, D]`` copy of every row's rows (a second copy of the whole KV of the
        layer, rebuilt each chunk), and the executor's score slices cover one row. The
        results are the batched query's: rows never interact, the plan of each row is its
        own; the stats are summed over rows (``estimated_mass`` averaged, as the batched
        query averages over all rows' query tokens).
        """
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device)
        totals = [0, 0, 0, 0, 0.0]
        for b, seq in enumerate(seqs):
            res = self.run([seq], layer, q[b:b + 1], scale, softcap)
            out[b:b + 1] = res.out
            lse[b:b + 1] = res.lse
            st = res.stats
            for i, value in enumerate((st.tokens_total, st.tokens_exact, st.units_retrieved,
                                       st.units_estimated, st.estimated_mass)):
                totals[i] += value
        stats = QueryStats(int(totals[0]), int(totals[1]), int(totals[2]), int(totals[3]),
                           totals[4] / len(seqs))
        return QueryResult(out=out, lse=lse, stats=stats)

    def decoder(self, seqs: list[Sequence], num_q_heads: int) -> BatchDecoder | None:
        """:meth:`Store.decoder <vecstore.engine.store.Store.decoder>`."""
        self.check_seqs(seqs, 0, stored=True)
        executor = self._executor
        if self._persistent or not isinstance(executor, WaveExecutor):
            return None
        first = seqs[0]
        a = self._config.attention
        n = first.layers[0].pending_keys.shape[1]
        if flush_due(n, a.window_tokens, a.update_tokens):
            return None  # the next step indexes the tails: an ordinary step
        dev = first.layers[0].device
        q = torch.empty(len(seqs), num_q_heads, 1, first.head_dim, dtype=first.dtype,
                        device=dev)
        layers = []
        for layer in range(first.num_layers):
            states = [s.layers[layer] for s in seqs]
            if states[0].device != dev or states[0].pending_keys.shape[1] != n:
                return None
            # equal rows share a tail buffer (gathered now if they do not yet)
            if not stack_steady(seqs, layer).persistent:
                return None
            index, config = self._layer(layer)
            try:
                view = self._batch_views.view(seqs, layer)
            except CapacityError:
                return None
            finally:
                self.retire_replaced(states)
            if not executor.can_run(index, view, q, config):
                return None
            assert view is not None and states[0].tail_buffer is not None
            prep = executor.prepare(view, config, index)
            layers.append(LayerStep(states, states[0].tail_buffer, prep))
        return BatchDecoder(executor, seqs, layers, n, a.window_tokens, a.update_tokens)

    def retire(self, views: Iterable[IndexView]) -> None:
        """Let the executor free what it prepared for ``views`` (their wave buffers: GPU
        memory charged to ``kvstore.gpu_budget_gb``), if it can."""
        release = getattr(self._executor, "release_view", None)
        if release is not None:
            for view in views:
                release(view)

    def retire_replaced(self, states: Iterable[LayerState]) -> None:
        """Retire the views ``states`` and the batch views replaced since last asked; where
        a view was replaced by appending to it, the executor may first hand what it
        prepared for it to its successor (a wave buffer's cache survives a segment flush)."""
        hand_over = getattr(self._executor, "hand_over", None)
        taken = [s.turnover.take() for s in [*states, self._batch_views]]
        for _, successions in taken:
            for old, new in successions:
                if hand_over is not None:
                    hand_over(old, new)
        for retired, _ in taken:
            self.retire(retired)

    def release_views(self) -> None:
        """Retire every stacked view, return its budget charges and forget the batch views
        (after a rollback, a drop, or at close)."""
        self._batch_views.clear()
        retired, _ = self._batch_views.turnover.take()  # none handed over to a cleared view
        self.retire(retired)
