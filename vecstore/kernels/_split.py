"""Split-K helpers shared by the Triton kernels: how many splits, their states, the combine.

A long reduction (over keys or clusters) is cut into ``S`` splits so that enough programs run
at small batch (flash-decoding). Each split writes a normalised partial state ``(out, lse)``;
:func:`combine_splits` merges the ``S`` states of every row by log-sum-exp in one launch.
With ``S = 1`` the split kernel writes the final state directly and no combine runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels._backend import LazyKernel, num_sms
from vecstore.kernels._device import store_merged

__all__ = ["plan_splits", "split_states", "combine_splits", "MAX_SPLITS"]

MAX_SPLITS = 64
# Programs to aim for per streaming multiprocessor; the interpreter (CPU) gets a small fixed
# target so that tests still exercise several splits on tiny shapes.
_PROGRAMS_PER_SM = 4
_INTERPRETER_PROGRAMS = 8


def plan_splits(rows: int, length: int, block: int, device: torch.device) -> tuple[int, int]:
    """Choose the splits of a reduction of ``length`` items over ``rows`` independent rows.

    Parameters
    ----------
    rows : int
        Independent rows (programs without splitting), e.g. ``B * Hkv``.
    length : int
        Items reduced per row (keys, clusters).
    block : int
        Items one loop iteration handles; a split covers a multiple of it.
    device : torch.device
        Where the kernel runs (its multiprocessor count sets the target).

    Returns
    -------
    num_splits : int
        Splits per row, ``1 <= num_splits <= MAX_SPLITS``.
    split_len : int
        Items per split, a multiple of ``block``; ``num_splits * split_len >= length``.
    """
    if device.type == "cuda":
        target = _PROGRAMS_PER_SM * num_sms(device)
    else:
        target = _INTERPRETER_PROGRAMS
    blocks = max(1, triton.cdiv(length, block))
    wanted = min(blocks, MAX_SPLITS, max(1, triton.cdiv(target, max(rows, 1))))
    split_len = triton.cdiv(blocks, wanted) * block
    return max(1, triton.cdiv(length, split_len)), split_len


def _combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    lse_i = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse_i, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_i - m_safe)  # [BLOCK_S]; 0 for empty or masked splits
    denom = tl.sum(w, axis=0)
    o = tl.load(
        part_out_ptr + (row * num_splits + offs_s)[:, None] * D + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    acc = tl.sum(w[:, None] * o, axis=0)
    store_merged(out_ptr, lse_ptr, row, offs_d, d_mask, acc, denom, m_safe, D)


_COMBINE = LazyKernel(_combine_kernel)


def split_states(
    out: torch.Tensor, lse: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the partial states ``(part_out, part_lse)`` a split kernel writes.

    With one split, ``out`` and ``lse`` themselves (the kernel writes the final state);
    otherwise new float32 ``[rows, S, D]`` and ``[rows, S]`` for :func:`combine_splits`, with
    ``rows = lse.numel()`` and ``D = out.shape[-1]``.
    """
    if num_splits == 1:
        return out, lse
    rows, dim = lse.numel(), out.shape[-1]
    return (
        torch.empty(rows, num_splits, dim, device=out.device, dtype=torch.float32),
        torch.empty(rows, num_splits, device=out.device, dtype=torch.float32),
    )


def combine_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge per-split states into ``out`` and ``lse`` (written in place).

    Nothing to do when the states are ``out`` and ``lse`` themselves (one split, see
    :func:`split_states`).

    Parameters
    ----------
    part_out : torch.Tensor
        ``[rows, S, D]`` float32 normalised partial outputs (0 for an empty split).
    part_lse : torch.Tensor
        ``[rows, S]`` float32 partial log-sum-exp (``-inf`` for an empty split).
    out : torch.Tensor
        ``[..., D]`` contiguous float32 of ``rows`` rows, written.
    lse : torch.Tensor
        ``[...]`` contiguous float32 of ``rows`` items, written (``-inf`` where every split is
        empty, with ``out`` 0).
    """
    if part_out is out:
        return
    rows, num_splits, dim = part_out.shape
    _COMBINE[(rows,)](
        part_out,
        part_lse,
        out,
        lse,
        num_splits,
        D=dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(dim),
    )
