"""Prefill: exact attention over the prompt, then ingest its KV into the store.

The prompt's tokens attend to each other exactly and causally (as the model's own SDPA
would), and their keys and values are appended to the store, which builds the index.
When the sequences already hold tokens (a conversation continued over a stored
document), the new tokens also attend to everything stored, through the store's query,
and the two partial results merge exactly by log-sum-exp.
"""

from __future__ import annotations

import torch

from attention.decode import ingest, query_store
from attention.exact import attention_with_lse, sdpa
from vecstore import Sequence, Store
from vecstore.executor.merge import merge
from vecstore.types import QueryStats

__all__ = ["prefill"]


def prefill(store: Store, seqs: list[Sequence], layer: int, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, *, scale: float, valid: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, QueryStats | None]:
    """Attention of a block of new tokens of one layer, then their ingestion.

    Parameters
    ----------
    store : Store
        The store holding ``seqs``.
    seqs : list[Sequence]
        One sequence per batch row.
    layer : int
        Layer index.
    q : torch.Tensor
        ``[B, Hq, L, D]`` queries of the new tokens.
    k, v : torch.Tensor
        ``[B, Hkv, L, D]`` their post-RoPE keys and values.
    scale : float
        Softmax scale.
    valid : torch.Tensor | None
        ``[B, L]`` bool, ``False`` for padding (left padding in a batch); padding is
        neither attended nor stored. ``None`` = no padding.

    Returns
    -------
    tuple[torch.Tensor, QueryStats | None]
        ``out [B, Hq, L, D]`` in ``q``'s dtype, and the store's stats when stored tokens
        were queried (``None`` for a first prefill).
    """
    stats = None
    if all(s.tokens(layer) == 0 for s in seqs):
        out = sdpa(q, k, v, scale=scale, valid=valid)
    else:
        out_past, lse_past, stats = query_store(store, seqs, layer, q, scale)
        out_new, lse_new = attention_with_lse(q, k, v, scale=scale, valid=valid)
        merged, _ = merge(out_past.float(), lse_past, out_new.float(), lse_new)
        out = merged.to(q.dtype)
    ingest(store, seqs, layer, k, v, valid)
    return out, stats
