"""Flash attention over the filled part of a preallocated KV cache, lengths on the device.

:func:`flash_varlen` attends ``B`` rows of ``L`` queries each to a cache laid out as
FlashAttention and vLLM lay theirs out, ``[B, S, Hkv, D]`` (token-major), row ``b`` reading
only its ``seqused[b]`` keys from slot ``starts[b]`` on. Where each row starts and how many
keys it uses are device tensors, so one CUDA graph captured for a batch serves every decode
step: the kernel reads the filled length when it runs, never more than it.

On CUDA it is :func:`attention.varlen.flash_forward`, FlashAttention-2 as vendored in
PyTorch (``aten::_flash_attention_forward``, its variable-length entry with ``seqused_k`` --
what vLLM's flash backend calls through flash-attn's ``flash_attn_varlen_func``):
grouped-query attention natively (the ``Hkv`` heads are read once for the ``Hq / Hkv`` query
heads of their group, never repeated), split-KV ("flash decoding") when each row has one
query, so a batch of one still fills the GPU, and causal masks aligned to the end of each
row (a prefill chunk sees the whole prefix and itself causally). Other ways to give a graph
a device-side length were weighed and left: capturing one graph per length bucket
re-captures every bucket and attends to the unfilled rest of a bucket (wrong unless masked,
and flash takes no mask); masking by a device length with SDPA gives up the flash backend;
``flex_attention`` needs ``torch.compile`` and a block mask rebuilt per step. Elsewhere
(CPU) a float32 torch reference with the same arguments and meaning runs, so the bookkeeping
around the kernel is tested without a GPU. """

from __future__ import annotations

import torch

from attention.varlen import SPLITS_SUPPORTED, check_splits, flash_forward

__all__ = ["SPLITS_SUPPORTED", "flash_varlen", "varlen_reference"]


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, seqused: torch.Tensor, max_q: int, causal: bool,
                 scale: float, num_splits: int = 0) -> torch.Tensor:
    """Attention of ``B`` rows of ``max_q`` queries over their rows of a KV cache.

    Parameters
    ----------
    q : torch.Tensor
        ``[B * max_q, Hq, D]``, row ``b``'s queries at ``b * max_q`` on.
    k, v : torch.Tensor
        ``[B, S, Hkv, D]`` contiguous: the cache of one layer (``Hq`` a multiple of ``Hkv``).
    cu_q : torch.Tensor
        ``[B + 1]`` int32, ``arange(B + 1) * max_q``.
    cu_k : torch.Tensor
        ``[B + 1]`` int32: ``b * S + starts[b]``, where row ``b``'s first key lives in the
        flattened ``[B * S]`` slots (``cu_k[B]`` is not read).
    seqused : torch.Tensor
        ``[B]`` int32: how many keys of row ``b`` from its start are attended to.
    max_q : int
        Queries per row.
    causal : bool
        Query ``i`` of a row sees the row's keys up to ``seqused - max_q + i`` (its own
        position when the row's last ``max_q`` keys are these queries' own).
    scale : float
        Softmax scale.
    num_splits : int
        How many parts each row's keys are split into when ``max_q`` is 1 (flash
        decoding; 0: FlashAttention's own choice from the batch, heads and ``S``). The
        result does not depend on it; the time does.

    Raises
    ------
    BackendUnavailableError
        If ``num_splits`` is set and this PyTorch cannot take it
        (:data:`SPLITS_SUPPORTED`).

    Returns
    -------
    torch.Tensor
        ``[B * max_q, Hq, D]`` in ``q``'s dtype; a query with no key to see gives zeros.
    """
    if not q.is_cuda:
        check_splits(num_splits)  # as the kernel would: a run here means the same there
        return varlen_reference(q, k, v, cu_k=cu_k, seqused=seqused, max_q=max_q,
                                causal=causal, scale=scale)
    B, S, H, D = k.shape
    return flash_forward(q, k.view(B * S, H, D), v.view(B * S, H, D), cu_q=cu_q, cu_k=cu_k,
                         max_q=max_q, max_k=S, causal=causal, scale=scale, seqused=seqused,
                         num_splits=num_splits)


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_k: torch.Tensor,
                     seqused: torch.Tensor, max_q: int, causal: bool,
                     scale: float) -> torch.Tensor:
    """:func:`flash_varlen` in float32 torch, on any device, without reading back any
    tensor (no host sync): the keys outside each row's range are masked, not sliced off."""
    B, S, Hkv, D = k.shape
    G = q.shape[1] // Hkv
    rows = torch.arange(B, device=k.device)
    start = cu_k[:B].long() - rows * S
    rel = torch.arange(S, device=k.device)[None, :] - start[:, None]  # [B, S]
    used = seqused.long()[:, None]
    keep = ((rel >= 0) & (rel < used))[:, None, :]  # [B, 1, S]
    if causal:
        i = torch.arange(max_q, device=k.device)[None, :, None]
        keep = keep & (rel[:, None, :] <= i + used[:, :, None] - max_q)  # [B, L, S]
    qf = q.view(B, max_q, Hkv, G, D).float()
    logits = torch.einsum("blhgd,bshd->bhgls", qf, k.float()) * scale
    logits = logits.masked_fill(~keep[:, None, None], float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    out = torch.einsum("bhgls,bshd->blhgd", p, v.float())
    return out.reshape(B * max_q, Hkv * G, D).to(q.dtype)
