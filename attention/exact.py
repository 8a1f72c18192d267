"""Exact causal attention of a step's tokens: over themselves, or over a stored prefix too.

Two entry points to the same computation (Vaswani et al. 2017), and the soft-capped one:

- :func:`sdpa` returns only the output and goes through
  ``torch.nn.functional.scaled_dot_product_attention`` exactly as transformers' ``sdpa``
  attention does (same mask, same GQA handling), so a prefill through vecstore is
  bit-identical to the model's own.
- :func:`sdpa_lower_right` is one row's block of new tokens over its stored prefix and
  itself (the prefill of a chunk after the first), through flash attention where CUDA
  has it.
- :func:`capped_attention` is the same attention with soft-capped logits (Gemma 2's
  ``attn_logit_softcapping``), which SDPA cannot compute: a plain matmul, ``tanh``, mask,
  softmax in float32, in slices of queries that bound the scores held at once. Both entry
  points above take it when given a ``softcap``.

:func:`sdpa` takes the new tokens' queries ``[B, Hq, L, D]``, keys and values
``[B, Hkv, L, D]`` and an optional validity mask ``[B, L]`` (``False`` = a padding
token, never attended).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from attention.gqa import group_size, repeat_kv
from vecstore.kernels.reference import softcap_
from vecstore.slicing import query_slices

__all__ = ["causal_mask", "sdpa", "sdpa_lower_right", "capped_attention"]


def causal_mask(valid: torch.Tensor | None, num_tokens: int,
                device: torch.device) -> torch.Tensor:
    """Boolean mask ``[B|1, 1, L, L]``: query ``i`` sees key ``j <= i`` if ``j`` is valid.

    Parameters
    ----------
    valid : torch.Tensor | None
        ``[B, L]`` bool, or ``None`` when every token is valid.
    num_tokens : int
        ``L``.

    Examples
    --------
    >>> causal_mask(torch.tensor([[False, True, True]]), 3, torch.device("cpu"))[0, 0].int()
    tensor([[0, 0, 0],
            [0, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """
    pos = torch.arange(num_tokens, device=device)
    mask = (pos[None, :] <= pos[:, None])[None, None]  # [1, 1, L, L]
    if valid is not None:
        mask = mask & valid[:, None, None, :]
    return mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
         valid: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over the step's own tokens (no lse).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, L, D]``.
    k, v : torch.Tensor
        ``[B, Hkv, L, D]``.
    scale : float
        Softmax scale.
    valid : torch.Tensor | None
        ``[B, L]`` bool; ``None`` = no padding.
    softcap : float | None
        Logit soft-cap: :func:`capped_attention` instead of SDPA; ``None``: no cap.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, L, D]`` in ``q``'s dtype; a query that sees no valid key (a left pad)
        gets zeros.
    """
    groups = group_size(q.shape[1], k.shape[1])
    L = q.shape[2]
    if softcap is not None:
        mask = None if valid is None else causal_mask(valid, L, q.device)
        return capped_attention(q, k, v, scale=scale, softcap=softcap, mask=mask)
    if valid is None or bool(valid.all()):
        # no mask: the fast path transformers takes (is_causal, GQA inside SDPA)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=L > 1,
                                              enable_gqa=groups > 1)
    mask = causal_mask(valid, L, q.device)
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                          attn_mask=mask, scale=scale)


def sdpa_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     scale: float, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last ``Lq`` of ``S`` tokens over all ``S`` (one row).

    Query ``i`` sits at position ``S - Lq + i`` and sees keys ``0 .. S - Lq + i``: a
    block of new tokens over its stored prefix and itself. The mask is torch's
    lower-right causal bias (``causal_lower_right``), which flash and memory-efficient
    attention apply on CUDA without building it, with GQA read in place (no repeated
    KV). Where neither kernel runs (CPU, unsupported dtypes) torch materialises the mask
    (and the math backend the scores), so the queries go in slices whose ``Hq x l x S``
    stay under :data:`vecstore.slicing.SCORE_BUDGET`.

    Parameters
    ----------
    q : torch.Tensor
        ``[Hq, Lq, D]``.
    k, v : torch.Tensor
        ``[Hkv, S, D]``, ``S >= Lq``, the stored tokens first (in any order) and the
        ``Lq`` new ones last, in order.
    scale : float
        Softmax scale.
    softcap : float | None
        Logit soft-cap: :func:`capped_attention` instead of SDPA; ``None``: no cap.

    Returns
    -------
    torch.Tensor
        ``[Hq, Lq, D]`` in ``q``'s dtype.

    Examples
    --------
    >>> q, k, v = torch.randn(4, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    >>> torch.allclose(sdpa_lower_right(q, k, v, scale=0.3),
    ...                sdpa(q[None], k[None], v[None], scale=0.3)[0], atol=1e-6)
    True
    """
    groups = group_size(q.shape[0], k.shape[0])
    Lq, S = q.shape[1], k.shape[1]
    q4, k4, v4 = q[None], k[None], v[None]
    if softcap is not None:
        return capped_attention(q4, k4, v4, scale=scale, softcap=softcap)[0]
    if _fused(q4, k4, v4, groups > 1):
        parts = [slice(0, Lq)]
    else:
        parts = query_slices(Lq, S, rows=q.shape[0])
    outs = []
    for part in parts:
        seen = S - Lq + part.stop  # keys the slice's last query sees
        outs.append(F.scaled_dot_product_attention(
            q4[:, :, part], k4[:, :, :seen], v4[:, :, :seen], scale=scale,
            attn_mask=causal_lower_right(part.stop - part.start, seen), enable_gqa=groups > 1))
    return outs[0][0] if len(outs) == 1 else torch.cat(outs, dim=2)[0]


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                     softcap: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with soft-capped logits: ``softmax(softcap * tanh(scale * q·k / softcap))``
    over the keys the mask lets each query see, computed in float32.

    SDPA has no soft-cap, so this is a plain matmul, ``tanh``, mask and softmax, in slices
    of queries whose ``B x Hq x l x S`` scores stay under
    :data:`vecstore.slicing.SCORE_BUDGET`.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, L, D]``.
    k, v : torch.Tensor
        ``[B, Hkv, S, D]``, ``S >= L``.
    scale : float
        Softmax scale.
    softcap : float
        Logit soft-cap.
    mask : torch.Tensor | None
        Broadcastable to ``[B, Hq, L, S]``: bool (``True`` = attended) or float (added to
        the capped scores, ``-inf`` = not attended). ``None``: causal, the ``L`` queries
        being the last ``L`` of the ``S`` keys' tokens (query ``i`` sees keys
        ``0 .. S - L + i``).

    Returns
    -------
    torch.Tensor
        ``[B, Hq, L, D]`` in ``q``'s dtype; a query that sees no key gets zeros.

    Examples
    --------
    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    >>> torch.allclose(capped_attention(q, k, v, scale=0.3, softcap=1e4),
    ...                sdpa(q, k, v, scale=0.3), atol=1e-5)
    True
    """
    groups = group_size(q.shape[1], k.shape[1])
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    kf, vf = repeat_kv(k, groups).float(), repeat_kv(v, groups).float()
    out = torch.empty_like(q)
    for part in query_slices(L, S, rows=B * Hq):
        logits = softcap_(torch.matmul(q[:, :, part].float(), kf.transpose(2, 3)).mul_(scale),
                          softcap)
        if mask is None:
            pos = torch.arange(S, device=q.device)
            rows = torch.arange(S - L + part.start, S - L + part.stop, device=q.device)
            logits.masked_fill_(pos[None, :] > rows[:, None], float("-inf"))
        elif mask.dtype == torch.bool:
            logits.masked_fill_(~mask[..., part, :], float("-inf"))
        else:
            logits += mask[..., part, :]
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        out[:, :, part] = torch.matmul(probs, vf).to(q.dtype)
    return out


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    """Whether a CUDA kernel applies the lower-right mask itself (as torch decides)."""
    if q.device.type != "cuda":
        return False
    params = SDPAParams(q, k, v, None, 0.0, False, gqa)
    return can_use_flash_attention(params) or can_use_efficient_attention(params)
