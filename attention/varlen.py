"""Rows of different lengths attended in one call: packed queries over packed keys.

A prefill chunk's rows each attend to their own stored prefix and to themselves. One
attention call per row leaves most of the GPU idle when a row's chunk is short (a row of
682 queries is 6 query blocks x 32 heads = 192 thread blocks, under one and a half waves
of the H200's 132 SMs); packing the rows of a batch into one call fills it.

- :func:`flash_forward` is FlashAttention-2 as vendored in PyTorch, its variable-length
  entry (``aten::_flash_attention_forward`` with cumulative offsets, what flash-attn's
  ``flash_attn_varlen_func`` and vLLM's flash backend call): grouped-query attention read
  in place (the ``Hkv`` heads are never repeated), causal masks aligned to the end of each
  row, keys and values in any layout whose last dimension is contiguous.
- :func:`varlen_attention` takes the rows' offsets as host integers and runs one
  :func:`flash_forward` where it applies (:func:`flash_applies`: CUDA from sm_80, float16
  or bfloat16, a head dim that is a multiple of 8 up to 256, no logit soft-cap), and row by
  row through :func:`attention.exact.sdpa_lower_right` elsewhere, with the same meaning.
"""

from __future__ import annotations

import torch

from attention.exact import sdpa_lower_right
from vecstore.errors import BackendUnavailableError

__all__ = ["SPLITS_SUPPORTED", "check_splits", "flash_applies", "flash_forward",
           "varlen_attention"]

SPLITS_SUPPORTED = any(a.name == "num_splits" for a in
                       torch.ops.aten._flash_attention_forward.default._schema.arguments)
"""Whether this PyTorch's flash attention takes ``num_splits`` (recent releases do; older
ones choose the split themselves, as ``num_splits=0`` does)."""


def flash_applies(q: torch.Tensor, k: torch.Tensor, *, softcap: float | None = None) -> bool:
    """Whether :func:`flash_forward` can attend ``q`` over ``k`` (``[T, H, D]`` each).

    Examples
    --------
    >>> flash_applies(torch.randn(4, 2, 8), torch.randn(4, 1, 8))  # a CPU tensor
    False
    """
    D = q.shape[-1]
    return (q.is_cuda and softcap is None and q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == q.dtype and D % 8 == 0 and D <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def check_splits(num_splits: int) -> None:
    """Raise :class:`BackendUnavailableError` if ``num_splits`` is set and this PyTorch's
    flash attention cannot take it (:data:`SPLITS_SUPPORTED`).

    Examples
    --------
    >>> check_splits(0)  # FlashAttention's own choice: every PyTorch takes it
    """
    if num_splits and not SPLITS_SUPPORTED:
        raise BackendUnavailableError("num_splits: this PyTorch's flash attention chooses "
                                      "the split itself; pass 0")


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float,
                  seqused: torch.Tensor | None = None, num_splits: int = 0) -> torch.Tensor:
    """FlashAttention-2 over packed rows (CUDA only).

    Parameters
    ----------
    q : torch.Tensor
        ``[Tq, Hq, D]``, row ``b``'s queries at ``cu_q[b] .. cu_q[b + 1]``.
    k, v : torch.Tensor
        ``[Tk, Hkv, D]`` (``Hq`` a multiple of ``Hkv``; last dimension contiguous), row
        ``b``'s keys from ``cu_k[b]`` on.
    cu_q, cu_k : torch.Tensor
        ``[B + 1]`` int32 on the device.
    max_q, max_k : int
        The most queries and keys of a row.
    causal : bool
        Query ``i`` of a row of ``n`` queries and ``S`` keys sees the row's keys up to
        ``S - n + i`` (the queries are the row's last ``n`` tokens).
    scale : float
        Softmax scale.
    seqused : torch.Tensor | None
        ``[B]`` int32: how many keys of row ``b`` are attended (``None``: up to
        ``cu_k[b + 1]``).
    num_splits : int
        How many parts a row's keys are split into when it has one query (flash
        decoding; 0: FlashAttention's own choice). The time depends on it, not the result.

    Returns
    -------
    torch.Tensor
        ``[Tq, Hq, D]`` in ``q``'s dtype; a query with no key to see gives zeros.

    Raises
    ------
    BackendUnavailableError
        ``num_splits`` is set and this PyTorch cannot take it (:func:`check_splits`).
    """
    check_splits(num_splits)
    extra = {"num_splits": num_splits} if num_splits else {}
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        seqused_k=seqused, **extra)[0]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_q: list[int],
                     cu_k: list[int], scale: float,
                     softcap: float | None = None) -> torch.Tensor:
    """Causal attention of packed rows, each row's queries being its last tokens.

    Parameters
    ----------
    q : torch.Tensor
        ``[Tq, Hq, D]``: row ``b``'s ``n_b`` queries at ``cu_q[b] .. cu_q[b + 1]``.
    k, v : torch.Tensor
        ``[Tk, Hkv, D]``: row ``b``'s ``S_b >= n_b`` keys at ``cu_k[b] .. cu_k[b + 1]``,
        its stored tokens first (in any order) and its ``n_b`` new ones last, in order.
        Any strides with a contiguous last dimension.
    cu_q, cu_k : list[int]
        Row offsets, ``B + 1`` each, from 0.
    scale : float
        Softmax scale.
    softcap : float | None
        Logit soft-cap (row by row, :func:`attention.exact.capped_attention`); ``None``:
        none.

    Returns
    -------
    torch.Tensor
        ``[Tq, Hq, D]`` in ``q``'s dtype: query ``i`` of row ``b`` over the row's keys up
        to ``S_b - n_b + i``.

    Examples
    --------
    Two rows packed give each row's own attention:

    >>> from attention.exact import sdpa_lower_right
    >>> q, k, v = torch.randn(5, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    >>> out = varlen_attention(q, k, v, cu_q=[0, 2, 5], cu_k=[0, 4, 9], scale=0.3)
    >>> row1 = sdpa_lower_right(q[2:].transpose(0, 1), k[4:].transpose(0, 1),
    ...                         v[4:].transpose(0, 1), scale=0.3)
    >>> torch.allclose(out[2:], row1.transpose(0, 1), atol=1e-6)
    True
    """
    if flash_applies(q, k, softcap=softcap):
        offsets = torch.tensor([cu_q, cu_k], dtype=torch.int32).to(q.device, non_blocking=True)
        return flash_forward(q, k, v, cu_q=offsets[0], cu_k=offsets[1], max_q=_longest(cu_q),
                             max_k=_longest(cu_k), causal=True, scale=scale)
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out[rq] = sdpa_lower_right(q[rq].transpose(0, 1), k[rk].transpose(0, 1),
                                   v[rk].transpose(0, 1), scale=scale,
                                   softcap=softcap).transpose(0, 1)
    return out


def _longest(offsets: list[int]) -> int:
    return max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
