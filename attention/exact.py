"""Exact causal attention over the tokens of one step, with or without log-sum-exp.

Two forms of the same computation (Vaswani et al. 2017):

- :func:`sdpa` returns only the output and goes through
  ``torch.nn.functional.scaled_dot_product_attention`` exactly as transformers' ``sdpa``
  attention does (same mask, same GQA handling), so a prefill through vecstore is
  bit-identical to the model's own.
- :func:`attention_with_lse` also returns the log-sum-exp, so the result merges exactly
  with attention over stored tokens (:func:`vecstore.executor.merge.merge`). It works in
  float32, in query chunks that bound the score matrix's memory.

Both take the new tokens' queries ``[B, Hq, L, D]``, keys and values ``[B, Hkv, L, D]``
and an optional validity mask ``[B, L]`` (``False`` = a padding token, never attended).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.gqa import group_size, repeat_kv

__all__ = ["causal_mask", "sdpa", "attention_with_lse"]

_SCORE_BUDGET = 1 << 26  # float32 scores held at once (256 MiB)


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
         valid: torch.Tensor | None = None) -> torch.Tensor:
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

    Returns
    -------
    torch.Tensor
        ``[B, Hq, L, D]`` in ``q``'s dtype; a query that sees no valid key (a left pad)
        gets zeros.
    """
    groups = group_size(q.shape[1], k.shape[1])
    L = q.shape[2]
    if valid is None or bool(valid.all()):
        # no mask: the fast path transformers takes (is_causal, GQA inside SDPA)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=L > 1,
                                              enable_gqa=groups > 1)
    mask = causal_mask(valid, L, q.device)
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                          attn_mask=mask, scale=scale)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                       valid: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the step's queries over its own tokens, with log-sum-exp.

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

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out [B, Hq, L, D]`` (``q``'s dtype) and ``lse [B, Hq, L]`` float32; a query
        that sees no valid key has ``out = 0`` and ``lse = -inf``.

    Examples
    --------
    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    >>> out, lse = attention_with_lse(q, k, v, scale=8 ** -0.5)
    >>> torch.allclose(out, sdpa(q, k, v, scale=8 ** -0.5), atol=1e-5)
    True
    """
    B, Hq, L, D = q.shape
    groups = group_size(Hq, k.shape[1])
    kf = repeat_kv(k.float(), groups)  # [B, Hq, L, D]
    vf = repeat_kv(v.float(), groups)
    mask = causal_mask(valid, L, q.device)  # [B|1, 1, L, L]
    chunk = max(1, _SCORE_BUDGET // max(1, B * Hq * L))
    outs, lses = [], []
    for i in range(0, L, chunk):
        # in place after the product: one [B, Hq, l, L] float32 tensor at a time
        logits = torch.matmul(q[:, :, i:i + chunk].float(), kf.transpose(2, 3)).mul_(scale)
        logits.masked_fill_(~mask[:, :, i:i + chunk], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)  # [B, Hq, l]
        probs = logits.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
        outs.append(torch.matmul(probs, vf))
        del logits, probs
        lses.append(lse)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
