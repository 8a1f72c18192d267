"""How a store takes appends: checked once, committed in one transaction."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vecstore.checks import check_all_finite, check_tensor
from vecstore.errors import ShapeError
from vecstore.tail import append_tails

if TYPE_CHECKING:
    from vecstore.query_engine import QueryEngine
    from vecstore.sequence import Sequence
    from vecstore.store import Store

__all__ = ["Writer"]


class Writer:
    """Appends tokens to the sequences of one :class:`~vecstore.store.Store`.

    Each call is one transaction of the store (joined to an open one): its layers are
    touched in it, so a rollback restores them.
    """

    def __init__(self, store: Store, queries: QueryEngine) -> None:
        self._store = store
        self._queries = queries

    def append(self, seq: Sequence, layer: int, keys: torch.Tensor,
               values: torch.Tensor, *, whole_segments: bool = False) -> None:
        """:meth:`Store.append_tokens <vecstore.store.Store.append_tokens>`."""
        store = self._store
        with store.transaction():
            store._current_txn().touch(seq, layer)
            seq.layers[layer].append(keys, values, whole_segments=whole_segments)

    def append_batch(self, seqs: list[Sequence], layer: int, keys: torch.Tensor,
                     values: torch.Tensor, *, finite: bool,
                     whole_segments: bool = False) -> None:
        """:meth:`Store.append_batch <vecstore.store.Store.append_batch>`."""
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
        keys, values = keys.to(dev).contiguous(), values.to(dev).contiguous()
        states = [seq.layers[layer] for seq in seqs]
        a = states[0].config.attention
        store = self._store
        with store.transaction():
            txn = store._current_txn()
            for seq in seqs:
                txn.touch(seq, layer)
            # a decode step of equal tails: two copies for the batch (vecstore.tail)
            if whole_segments or not append_tails(states, keys, values, a.window_tokens,
                                                  a.update_tokens, a.sink_tokens):
                for b, state in enumerate(states):
                    state.append(keys[b], values[b], whole_segments=whole_segments)

    def seal(self, seqs: list[Sequence], layer: int) -> None:
        """:meth:`Store.seal <vecstore.store.Store.seal>`."""
        self._queries.check_seqs(seqs, layer, stored=False)
        store = self._store
        with store.transaction():
            txn = store._current_txn()
            for seq in seqs:
                txn.touch(seq, layer)
                seq.layers[layer].seal()
