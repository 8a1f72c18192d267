"""How a store takes appends: checked once, recorded in the store's transaction."""

from __future__ import annotations

import torch

from vecstore.checks import check_all_finite, check_tensor
from vecstore.engine.batch_build import commit_together
from vecstore.engine.query_engine import QueryEngine
from vecstore.engine.sequence import Sequence
from vecstore.engine.shared_tail import append_tails
from vecstore.engine.transaction import Transaction
from vecstore.errors import ShapeError

__all__ = ["Writer"]


class Writer:
    """Appends tokens to the sequences of one :class:`~vecstore.engine.store.Store`.

    Each call runs inside a transaction of the store, given to it: the layers it changes
    are touched in it first, so a rollback restores them. Index views the appends replace
    go to ``queries`` to be retired.
    """

    def __init__(self, queries: QueryEngine) -> None:
        self._queries = queries

    def check_batch(self, seqs: list[Sequence], layer: int, keys: torch.Tensor,
                    values: torch.Tensor, *, finite: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the arguments of :meth:`append_batch`; returns ``keys, values`` contiguous
        on the sequences' device."""
        self._queries.check_seqs(seqs, layer, stored=False)
        first = seqs[0]
        shape = (len(seqs), first.num_kv_heads, None, first.head_dim)
        check_tensor(keys, "keys", shape=shape, dtype=first.dtype)
        check_tensor(values, "values", shape=tuple(keys.shape), dtype=first.dtype)
        if keys.shape[2] == 0:
            raise ShapeError(f"keys: expected at least one token, got shape {tuple(keys.shape)}")
        if finite:
            check_all_finite(keys=keys, values=values)
        dev = first.layers[layer].device
        return keys.to(dev).contiguous(), values.to(dev).contiguous()

    def append(self, txn: Transaction, seq: Sequence, layer: int, keys: torch.Tensor,
               values: torch.Tensor, *, whole_segments: bool = False) -> None:
        """:meth:`Store.append_tokens <vecstore.engine.store.Store.append_tokens>`."""
        txn.touch(seq, layer)
        state = seq.layers[layer]
        try:
            state.append(keys, values, whole_segments=whole_segments)
        finally:
            self._queries.retire_replaced([state])

    def append_batch(self, txn: Transaction, seqs: list[Sequence], layer: int,
                     keys: torch.Tensor, values: torch.Tensor, *,
                     whole_segments: bool = False) -> None:
        """Append the arguments :meth:`check_batch` returned
        (:meth:`Store.append_batch <vecstore.engine.store.Store.append_batch>`)."""
        states = [seq.layers[layer] for seq in seqs]
        a = states[0].config.attention
        for seq in seqs:
            txn.touch(seq, layer)
        try:
            # a decode step of equal tails: two copies for the batch (vecstore.engine.shared_tail)
            if whole_segments or not append_tails(states, keys, values, a.window_tokens,
                                                  a.update_tokens, a.sink_tokens):
                commit_together(states, [
                    state.stage(keys[b], values[b], whole_segments=whole_segments)
                    for b, state in enumerate(states)])
        finally:
            self._queries.retire_replaced(states)

    def seal(self, txn: Transaction, seqs: list[Sequence], layer: int) -> None:
        """:meth:`Store.seal <vecstore.engine.store.Store.seal>`; ``seqs`` checked
        (:meth:`QueryEngine.check_seqs`)."""
        states = [seq.layers[layer] for seq in seqs]
        for seq in seqs:
            txn.touch(seq, layer)
        try:
            commit_together(states, [state.stage_seal() for state in states])
        finally:
            self._queries.retire_replaced(states)
