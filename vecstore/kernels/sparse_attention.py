"""Exact decode attention over a subset of the KV cache, returned as an attention state.

Two entry points compute the same thing, ``softmax(s q K^T) V`` over selected rows, for one
query token per sequence with grouped-query attention:

- :func:`sparse_decode_attention` reads the first ``lengths[b, h]`` rows of gathered buffers
  (the steady zone plus retrieved clusters copied into one execution buffer);
- :func:`sparse_attention_by_clusters` reads retrieved clusters in place from a
  cluster-contiguous store by ``(start, length)``, so no gathered copy is materialised.

On CUDA both run a split-K (flash-decoding) Triton kernel (Dao et al., 2023, "Flash-Decoding
for long-context inference"). Outputs are float32 whatever the input dtype, so that zones merge
by :func:`vecstore.kernels.merge.merge_states` without rounding.
"""

from __future__ import annotations

import torch

from vecstore.kernels._backend import Backend, resolve_backend
from vecstore.kernels._validate import (
    check_scale,
    float_input,
    group_size,
    int_input,
    same_device,
    state_outputs,
)

__all__ = ["sparse_decode_attention", "sparse_attention_by_clusters"]


def sparse_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    backend: Backend = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of each query head over the first ``lengths`` rows of its KV buffer.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, D]`` query, float32, float16 or bfloat16.
    k_buf, v_buf : torch.Tensor
        ``[B, Hkv, M, D]`` keys and values, same dtype as ``q``; ``Hkv`` divides ``Hq``. Rows at
        or after ``lengths[b, h]`` are never read into the result (they may hold anything).
    lengths : torch.Tensor
        ``[B, Hkv]`` integer rows to attend per KV head, clamped to ``[0, M]``.
    scale : float
        Softmax scale, usually ``1 / sqrt(D)``.
    backend : {"auto", "triton", "torch"}
        ``"auto"`` runs Triton on CUDA tensors and torch otherwise.
    out : tuple of torch.Tensor, optional
        Preallocated ``(out, lse)`` to write (contiguous, same device, the shapes and dtypes
        below), e.g. for CUDA graphs; new tensors when omitted.

    Returns
    -------
    out : torch.Tensor
        ``[B, Hq, D]`` float32 (for every input dtype); 0 where the length is 0.
    lse : torch.Tensor
        ``[B, Hq]`` float32 log-sum-exp of the scaled scores; ``-inf`` where the length is 0.

    Raises
    ------
    ShapeError
        If a shape, dtype or device does not match.
    InvalidValueError
        If ``scale`` is out of range or ``backend`` is unknown.
    BackendUnavailableError
        If ``backend="triton"`` cannot run here.

    Examples
    --------
    >>> import torch
    >>> q = torch.zeros(1, 1, 2)                             # equal scores: a plain mean
    >>> k = torch.randn(1, 1, 3, 2)
    >>> v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [float("nan"), 0.0]]]])
    >>> out, lse = sparse_decode_attention(q, k, v, torch.tensor([[2]]), 1.0)
    >>> out.tolist(), round(lse.item(), 4)                    # row 2 is past the length
    ([[[2.0, 3.0]]], 0.6931)
    """
    q, k_buf, v_buf, scale = _check_qkv(q, k_buf, v_buf, scale)
    batch, num_kv_heads = k_buf.shape[0], k_buf.shape[1]
    lengths = int_input(lengths, "lengths", (batch, num_kv_heads))
    device = same_device(q=q, k_buf=k_buf, v_buf=v_buf, lengths=lengths)
    result, lse = state_outputs(out, *q.shape, q.device)
    if resolve_backend(backend, device) == "triton":
        from vecstore.kernels._attention_kernels import buffer_attention_triton

        buffer_attention_triton(q, k_buf, v_buf, lengths, scale, result, lse)
        return result, lse
    num_rows = k_buf.shape[2]
    positions = torch.arange(num_rows, device=device)
    is_valid = positions < lengths.long().clamp(0, num_rows).unsqueeze(-1)  # [B, Hkv, M]
    return _masked_attention(q, k_buf, v_buf, is_valid, scale, result, lse)


def sparse_attention_by_clusters(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    backend: Backend = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over clusters read in place from a cluster-contiguous store.

    Cluster ``r`` of KV head ``(b, h)`` covers rows ``[starts[b, h, r], starts[b, h, r] +
    lengths[b, h, r])`` of ``keys[b, h]`` and ``values[b, h]``, intersected with ``[0, N)``.
    Ranges should not overlap (an overlapping row counts twice); a length of 0 is padding.
    The Triton path reads the ranges in place and never syncs with the host; the torch fallback
    gathers them (padded to the longest range, read with one host sync), so only the Triton
    path can be captured in a CUDA graph.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, D]`` query, float32, float16 or bfloat16.
    keys, values : torch.Tensor
        ``[B, Hkv, N, D]`` cluster-contiguous store, same dtype as ``q``.
    starts, lengths : torch.Tensor
        ``[B, Hkv, R]`` integer first row and row count of each retrieved cluster.
    scale : float
        Softmax scale, usually ``1 / sqrt(D)``.
    backend : {"auto", "triton", "torch"}
        ``"auto"`` runs Triton on CUDA tensors and torch otherwise.
    out : tuple of torch.Tensor, optional
        Preallocated ``(out, lse)`` to write (contiguous, same device, the shapes and dtypes
        below), e.g. for CUDA graphs; new tensors when omitted.

    Returns
    -------
    out : torch.Tensor
        ``[B, Hq, D]`` float32; 0 where no row is selected.
    lse : torch.Tensor
        ``[B, Hq]`` float32; ``-inf`` where no row is selected.

    Raises
    ------
    ShapeError
        If a shape, dtype or device does not match.
    InvalidValueError
        If ``scale`` is out of range or ``backend`` is unknown.
    BackendUnavailableError
        If ``backend="triton"`` cannot run here.

    Examples
    --------
    >>> import torch
    >>> q = torch.zeros(1, 1, 1)
    >>> store = torch.arange(6.0).view(1, 1, 6, 1)           # rows 0..5, value = row
    >>> starts, lengths = torch.tensor([[[4, 0]]]), torch.tensor([[[2, 1]]])
    >>> out, lse = sparse_attention_by_clusters(q, store, store, starts, lengths, 1.0)
    >>> round(out.item(), 4)                                 # mean of rows 4, 5 and 0
    3.0
    """
    q, keys, values, scale = _check_qkv(q, keys, values, scale, names=("keys", "values"))
    batch, num_kv_heads, num_rows = keys.shape[0], keys.shape[1], keys.shape[2]
    starts = int_input(starts, "starts", (batch, num_kv_heads, None))
    lengths = int_input(lengths, "lengths", starts.shape)
    device = same_device(q=q, keys=keys, values=values, starts=starts, lengths=lengths)
    result, lse = state_outputs(out, *q.shape, q.device)
    if resolve_backend(backend, device) == "triton":
        from vecstore.kernels._attention_kernels import cluster_attention_triton

        cluster_attention_triton(q, keys, values, starts, lengths, scale, result, lse)
        return result, lse
    # Torch fallback: expand the ranges to row ids (padded to the longest range) and gather.
    longest = int(lengths.max()) if lengths.numel() and num_rows else 0
    offsets = torch.arange(max(longest, 0), device=device)
    row_ids = starts.long().unsqueeze(-1) + offsets  # [B, Hkv, R, L]
    is_valid = (offsets < lengths.long().unsqueeze(-1)) & (row_ids >= 0) & (row_ids < num_rows)
    row_ids = torch.where(is_valid, row_ids, torch.zeros_like(row_ids)).flatten(2)
    is_valid = is_valid.flatten(2)  # [B, Hkv, R * L]
    index = row_ids.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    gathered_keys, gathered_values = keys.gather(2, index), values.gather(2, index)
    return _masked_attention(q, gathered_keys, gathered_values, is_valid, scale, result, lse)


def _check_qkv(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    names: tuple[str, str] = ("k_buf", "v_buf"),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Check ``q [B, Hq, D]`` and ``keys``/``values [B, Hkv, *, D]`` of ``q``'s dtype."""
    q = float_input(q, "q", (None, None, None))
    batch, num_q_heads, dim = q.shape
    keys = float_input(keys, names[0], (batch, None, None, dim), q.dtype)
    values = float_input(values, names[1], tuple(keys.shape), q.dtype)
    group_size(num_q_heads, keys.shape[1])
    return q, keys, values, check_scale(scale)


def _masked_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    is_valid: torch.Tensor,
    scale: float,
    result: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch attention of ``q [B, Hq, D]`` over rows of ``[B, Hkv, T, D]`` where ``is_valid``.

    Writes and returns float32 ``result [B, Hq, D]`` and ``lse [B, Hq]`` (0 and ``-inf`` for
    empty rows).
    """
    batch, num_q_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    q_grouped = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)
    scores = torch.matmul(q_grouped, keys.float().transpose(-1, -2)) * scale  # [B, Hkv, G, T]
    scores = scores.masked_fill(~is_valid.unsqueeze(2), float("-inf"))
    group_lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]
    ref = torch.where(torch.isneginf(group_lse), torch.zeros_like(group_lse), group_lse)
    probs = torch.exp(scores - ref.unsqueeze(-1))
    masked_values = values.float().masked_fill(~is_valid.unsqueeze(-1), 0.0)  # may hold NaN
    result.copy_(torch.matmul(probs, masked_values).view(batch, num_q_heads, dim))
    lse.copy_(group_lse.view(batch, num_q_heads))
    return result, lse
