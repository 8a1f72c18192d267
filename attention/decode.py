"""Decode: store the new token, then attend to everything stored through the store.

A decode step appends its token to each row's sequence first, so the token joins the
steady zone and the store's tripartite query (exact steady zone + retrieved clusters +
estimated clusters) covers the whole context, the new token included, in one batched
call.
"""

from __future__ import annotations

import torch

from vecstore import Sequence, Store
from vecstore.checks import check_all_finite
from vecstore.types import QueryStats

__all__ = ["ingest", "query_store", "decode"]


def ingest(store: Store, seqs: list[Sequence], layer: int, k: torch.Tensor, v: torch.Tensor,
           valid: torch.Tensor | None, *, finite: bool = True,
           whole_segments: bool = False) -> None:
    """Append each row's valid tokens to its sequence (padding is never stored).

    Parameters
    ----------
    store : Store
        The store holding ``seqs``.
    seqs : list[Sequence]
        ``B`` sequences, one per batch row.
    layer : int
        Layer index.
    k, v : torch.Tensor
        ``[B, Hkv, L, D]`` post-RoPE keys and values of the step.
    valid : torch.Tensor | None
        ``[B, L]`` bool; ``None`` = every token is valid.
    finite : bool
        Scan each row's keys and values for NaN/Inf (``False``: the caller did, for all
        rows at once).
    whole_segments : bool
        A prefill chunk: index only whole ``index.segment_tokens`` segments
        (:meth:`vecstore.Store.append_batch`).
    """
    if valid is None:
        store.append_batch(seqs, layer, k, v, finite=finite, whole_segments=whole_segments)
        return
    for b, seq in enumerate(seqs):
        keep = valid[b].nonzero().flatten()
        if keep.numel():
            seq.append(layer, k[b].index_select(1, keep), v[b].index_select(1, keep),
                       finite=finite, whole_segments=whole_segments)


def query_store(store: Store, seqs: list[Sequence], layer: int, q: torch.Tensor,
                scale: float, *, finite: bool = True, softcap: float | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, QueryStats | None]:
    """Attention of each row's queries over every token its sequence stores.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, L, D]``.
    finite : bool
        Scan ``q`` for NaN/Inf (``False``: the caller did).
    softcap : float | None
        Attention logit soft-cap (:meth:`vecstore.Store.query`); ``None``: none.

    Returns
    -------
    tuple
        ``out [B, Hq, L, D]`` (``q``'s dtype), ``lse [B, Hq, L]`` float32 (``-inf`` and
        zeros for rows that store nothing yet) and the store's stats (``None`` when no
        row stores anything).
    """
    rows = [b for b, s in enumerate(seqs) if s.tokens(layer) > 0]
    if len(rows) == len(seqs):
        res = store.query(seqs, layer, q, scale=scale, finite=finite, softcap=softcap)
        return res.out.to(q.device), res.lse.to(q.device), res.stats
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    if not rows:
        return out, lse, None
    index = torch.tensor(rows, device=q.device)
    res = store.query([seqs[b] for b in rows], layer, q.index_select(0, index), scale=scale,
                      softcap=softcap)
    out.index_copy_(0, index, res.out.to(q.device))
    lse.index_copy_(0, index, res.lse.to(q.device))
    return out, lse, res.stats


def decode(store: Store, seqs: list[Sequence], layer: int, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, *, scale: float, valid: torch.Tensor | None = None,
           softcap: float | None = None) -> tuple[torch.Tensor, QueryStats | None]:
    """One decode step of one layer: append the new token, then query the store.

    Parameters
    ----------
    store : Store
        The store holding ``seqs``.
    seqs : list[Sequence]
        One sequence per batch row.
    layer : int
        Layer index.
    q : torch.Tensor
        ``[B, Hq, 1, D]`` the new token's queries.
    k, v : torch.Tensor
        ``[B, Hkv, 1, D]`` its post-RoPE keys and values.
    scale : float
        Softmax scale.
    valid : torch.Tensor | None
        ``[B, 1]`` bool; a row whose token is padding stores nothing.
    softcap : float | None
        Attention logit soft-cap; ``None``: none.

    Returns
    -------
    tuple[torch.Tensor, QueryStats | None]
        ``out [B, Hq, 1, D]`` and the store's stats for the step.
    """
    if valid is None:
        # every row stores its token and is queried: one NaN/Inf scan (one host sync) for
        # k, v and q of all rows, before anything is stored, and one transaction
        check_all_finite(keys=k, values=v, q=q)
        ingest(store, seqs, layer, k, v, None, finite=False)
        out, _, stats = query_store(store, seqs, layer, q, scale, finite=False,
                                    softcap=softcap)
        return out, stats
    ingest(store, seqs, layer, k, v, valid)
    out, _, stats = query_store(store, seqs, layer, q, scale, softcap=softcap)
    return out, stats
