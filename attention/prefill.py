"""Prefill: exact attention of a block of new tokens, then their ingestion.

A block (a prompt, or one chunk of a prompt fed over several forward passes) attends
exactly: each token to everything its row already stores and causally to the block's
tokens up to itself. Prefill is compute-bound, so reading the stored prefix sparsely
would save nothing; it is read whole, with flash attention where CUDA has it.

- No row stores anything and none is padded: one batched SDPA call, the one
  transformers makes (:func:`attention.exact.sdpa`), so the outputs are bit-identical.
- Otherwise in groups of rows: each row's stored blocks (:meth:`vecstore.Sequence.kv_blocks`)
  and its valid new tokens, packed with the group's other rows (up to
  ``attention.prefill_group_gb`` of keys and values) into one ``[Hkv, T, D]`` pair on the
  device (:func:`attention.prefix.groups_on_device`; rows held in pinned host
  memory go one a group, copied one row ahead on a side stream), attended by the rows' valid
  queries, each row's with a lower-right causal mask, in one call
  (:func:`attention.varlen.varlen_attention`: FlashAttention-2's variable-length entry on
  CUDA, row by row elsewhere). Padding (left padding, rows of different lengths) is never
  attended; padded queries get zeros.

Rows in a tier that is not resident (``kvstore.kind = "pinned"``) would copy their whole
stored prefix to the device again every chunk; given a :class:`attention.prefix_mirror.PrefixMirror`
(``attention.prefill_mirror_gb``, which :class:`attention.StoreAttention` passes), such a
row's prefix stays on the device across the chunks, each chunk appending its valid tokens,
and the row attends to that one block (rows it cannot hold are read from the tier).

The valid tokens are then appended to the store in whole index segments
(``whole_segments``): a prompt is clustered in ``index.segment_tokens`` segments whatever
its chunks, and what is left is indexed by the first decode step.

With a logit ``softcap`` (Gemma 2) both cases compute the soft-capped attention instead
(:func:`attention.exact.capped_attention`: SDPA has no soft-cap).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from attention.decode import ingest
from attention.exact import sdpa
from attention.prefix import Blocks, groups_on_device
from attention.prefix_mirror import PrefixMirror
from attention.varlen import varlen_attention
from vecstore import Sequence, Store
from vecstore.checks import FiniteCheck

__all__ = ["prefill"]

_Selection = slice | torch.Tensor | None
"""A row's valid tokens of a block (:func:`_valid_tokens`)."""
_Block = tuple[torch.Tensor, torch.Tensor] | None
"""A row's stored and new keys and values in one mirror block, or ``None``."""


def prefill(store: Store, seqs: list[Sequence], layer: int, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, *, scale: float, valid: torch.Tensor | None = None,
            softcap: float | None = None, mirror: PrefixMirror | None = None) -> torch.Tensor:
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
    softcap : float | None
        Attention logit soft-cap, ``softcap * tanh(score / softcap)``; ``None``: none.
    mirror : PrefixMirror | None
        Where the stored prefixes of rows whose tier is not resident are kept on the
        device across a prompt's chunks (the same mirror for every chunk and layer; its
        entries of sequences not in ``seqs`` are dropped). ``None``: such rows are read
        from their tier every chunk.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, L, D]`` in ``q``'s dtype, exact whatever the store's budgets.

    Raises
    ------
    InvalidValueError
        A valid token's key or value is NaN or Inf; no row stores anything.

    Examples
    --------
    A prompt prefilled in two chunks gives the one-pass prefill's output:

    >>> q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    >>> with Store.open() as store:
    ...     one, two = ([store.create(n, num_layers=1, num_kv_heads=2, head_dim=8,
    ...                               dtype=torch.float32)] for n in ("one", "two"))
    ...     whole = prefill(store, one, 0, q, k, v, scale=0.3)
    ...     first = prefill(store, two, 0, q[:, :, :4], k[:, :, :4], v[:, :, :4], scale=0.3)
    ...     rest = prefill(store, two, 0, q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], scale=0.3)
    >>> torch.allclose(torch.cat([first, rest], dim=2), whole, atol=1e-6)
    True
    """
    # every row's tokens checked at once (a bad row stores nothing in any row): the scan is
    # queued before the attention and read after its launch, before anything is stored. The
    # host waits for the scan alone, so the device runs the attention meanwhile, and the
    # host's work up to the launch overlaps the device's earlier work
    pad = None if valid is None else ~valid[:, None, :, None]
    check = FiniteCheck(keys=k if pad is None else k.masked_fill(pad, 0),
                        values=v if pad is None else v.masked_fill(pad, 0))
    keep = _valid_tokens(valid, q.shape[0], q.shape[2])
    mirrored: list[_Block] = ([None] * len(seqs) if mirror is None
                              else _mirrored(store, seqs, layer, k, v, keep, mirror))
    if valid is None and all(s.tokens(layer) == 0 for s in seqs):
        out = sdpa(q, k, v, scale=scale, valid=None, softcap=softcap)
    else:
        group_bytes = int(store.config.attention.prefill_group_gb * 2**30)
        out = _attend_rows(seqs, layer, q, k, v, scale, valid, keep, mirrored, softcap,
                           group_bytes)
    check.wait()
    ingest(store, seqs, layer, k, v, valid, finite=False, whole_segments=True)
    return out


def _mirrored(store: Store, seqs: list[Sequence], layer: int, k: torch.Tensor,
              v: torch.Tensor, keep: list[_Selection], mirror: PrefixMirror) -> list[_Block]:
    """Per row: its stored tokens and valid new ones as one block of ``mirror``, or
    ``None`` (a resident tier, no valid token, or no room in the mirror)."""
    mirror.retain(seqs)
    return [None if sel is None or store.placement.tier(seq.layer_devices[layer]).resident
            else mirror.extend(seq, layer, _take(k[b], sel), _take(v[b], sel))
            for b, (seq, sel) in enumerate(zip(seqs, keep, strict=True))]


def _attend_rows(seqs: list[Sequence], layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, scale: float, valid: torch.Tensor | None,
                 keep: list[_Selection], mirrored: list[_Block], softcap: float | None,
                 group_bytes: int) -> torch.Tensor:
    """Each row's valid queries (``keep``) over its stored tokens and its valid new ones
    (its ``mirrored`` block when it has one), a group of rows (up to ``group_bytes`` of
    keys and values) per attention call."""
    out = torch.zeros_like(q) if valid is not None else torch.empty_like(q)
    rows = [b for b, sel in enumerate(keep) if sel is not None]
    blocks: list[Blocks] = [
        [held] if (held := mirrored[b]) is not None else
        [*seqs[b].kv_blocks(layer), (_take(k[b], keep[b]), _take(v[b], keep[b]))]
        for b in rows]
    for group in groups_on_device(blocks, q.device, max_bytes=group_bytes):
        batch = [rows[i] for i in group.rows]
        queries = [_take(q[b], keep[b]).transpose(0, 1) for b in batch]  # [n, Hq, D] each
        cu_q = list(accumulate((x.shape[0] for x in queries), initial=0))
        o = varlen_attention(queries[0] if len(queries) == 1 else torch.cat(queries),
                             group.keys.transpose(0, 1), group.values.transpose(0, 1),
                             cu_q=cu_q, cu_k=group.offsets, scale=scale, softcap=softcap)
        for i, b in enumerate(batch):
            part, sel = o[cu_q[i]:cu_q[i + 1]].transpose(0, 1), keep[b]
            if isinstance(sel, slice):
                out[b, :, sel] = part
            else:
                out[b].index_copy_(1, sel, part)
        del group, o  # the next group's keys and values may take their memory
    return out


def _valid_tokens(valid: torch.Tensor | None, B: int, L: int) -> list[_Selection]:
    """Per row: a slice of its valid tokens when they are the last ones (no padding, or
    left padding), else their indices; ``None`` for a row of padding only."""
    if valid is None:
        return [slice(0, L)] * B
    counts = valid.sum(1)
    left = torch.arange(L, device=valid.device)[None, :] >= (L - counts)[:, None]
    if torch.equal(left, valid):  # one host sync for the whole batch
        return [slice(L - n, L) if n else None for n in counts.tolist()]
    return [idx if idx.numel() else None
            for idx in (row.nonzero().flatten() for row in valid)]


def _take(x: torch.Tensor, sel: slice | torch.Tensor) -> torch.Tensor:
    """``x [H, L, D]`` at the selected tokens (a view for a slice)."""
    return x[:, sel] if isinstance(sel, slice) else x.index_select(1, sel)
