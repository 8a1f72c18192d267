"""One kernel for the bookkeeping around a captured decode step of one layer.

A fixed-shape decode step (:class:`vecstore.engine.decoder.BatchDecoder`) adds, per layer, the
step's :class:`~vecstore.types.QueryStats` fields to a device accumulator and checks its
``q``, keys and values for NaN/Inf. In torch that is some twenty small kernels a layer
(gathers, sums, a log-sum-exp, roundings, a concatenation); :func:`accumulate_step` does
both in one launch. The torch form it replaces stays the reference the tests compare with
(:func:`vecstore.executor.wave_state.step_stats`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels.backend import LazyKernel

__all__ = ["accumulate_step"]

_FINITE_BLOCK = 4096


@triton.jit
def _bad(ptr, offs, n):
    # 1 where a loaded value is NaN or +-Inf
    x = tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    return ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)


def _step_stats_kernel(cum_ptr, cum_stride, count_ptr, est_count_ptr, rows,
                       parts_ptr, parts_stride, num_exact, num_parts, lse_ptr, qrows,
                       steady_ptr, B, indexed_per_head, H, stats_ptr,
                       x_ptr, x_numel, y_ptr, y_numel, z_ptr, z_numel, finite_ptr,
                       ROWS_BLOCK: tl.constexpr, QROWS_BLOCK: tl.constexpr,
                       PARTS_BLOCK: tl.constexpr, B_BLOCK: tl.constexpr,
                       FINITE_BLOCK: tl.constexpr, CHECK: tl.constexpr):
    pid = tl.program_id(0)
    if CHECK:
        # every program checks one block of q, k and v; a bad value clears the flag
        offs = pid * FINITE_BLOCK + tl.arange(0, FINITE_BLOCK)
        bad = (_bad(x_ptr, offs, x_numel) | _bad(y_ptr, offs, y_numel)
               | _bad(z_ptr, offs, z_numel))
        if tl.max(bad, axis=0) > 0:
            tl.atomic_min(finite_ptr, 0)
    if pid == 0:
        # tokens read exactly: the retrieved clusters' rows, counted at cum[count]
        exact = tl.zeros([ROWS_BLOCK], dtype=tl.int64)
        retrieved = tl.zeros([ROWS_BLOCK], dtype=tl.int64)
        estimated = tl.zeros([ROWS_BLOCK], dtype=tl.int64)
        for r0 in range(0, rows, ROWS_BLOCK):
            r = r0 + tl.arange(0, ROWS_BLOCK)
            m = r < rows
            cnt = tl.load(count_ptr + r, mask=m, other=0)
            exact += tl.load(cum_ptr + r.to(tl.int64) * cum_stride + cnt, mask=m,
                             other=0).to(tl.int64)
            retrieved += cnt.to(tl.int64)
            estimated += tl.load(est_count_ptr + r, mask=m, other=0).to(tl.int64)
        n_exact = tl.sum(exact, axis=0)
        n_est = tl.sum(estimated, axis=0)
        # the estimated parts' share of each query row's softmax mass, averaged
        share = tl.zeros([QROWS_BLOCK], dtype=tl.float32)
        for q0 in range(0, qrows, QROWS_BLOCK):
            q = q0 + tl.arange(0, QROWS_BLOCK)
            qm = q < qrows
            # the estimated parts' log-sum-exp, PARTS_BLOCK parts at a time (a running max
            # and mass): the number of parts grows with the layer, a block size would not
            top = tl.full([QROWS_BLOCK], float("-inf"), dtype=tl.float32)
            mass_e = tl.zeros([QROWS_BLOCK], dtype=tl.float32)
            for p0 in range(num_exact, num_parts, PARTS_BLOCK):
                p = p0 + tl.arange(0, PARTS_BLOCK)
                parts = tl.load(parts_ptr + q.to(tl.int64)[:, None] * parts_stride
                                + p[None, :], mask=qm[:, None] & (p < num_parts)[None, :],
                                other=float("-inf"))
                new_top = tl.maximum(top, tl.max(parts, axis=1))
                safe = tl.where(new_top == float("-inf"), 0.0, new_top)
                mass_e = (mass_e * tl.exp(top - safe)
                          + tl.sum(tl.exp(parts - safe[:, None]), axis=1))
                top = new_top
            safe = tl.where(top == float("-inf"), 0.0, top)
            lse_e = tl.where(mass_e > 0, safe + tl.log(tl.maximum(mass_e, 1e-30)),
                             float("-inf"))
            s = tl.exp(lse_e - tl.load(lse_ptr + q, mask=qm, other=0.0))
            share += tl.where(qm & (s == s), s, 0.0)
        mass = tl.where(n_est > 0, (tl.sum(share, axis=0) / qrows).to(tl.float64), 0.0)
        b = tl.arange(0, B_BLOCK)
        steady = tl.sum(tl.load(steady_ptr + b, mask=b < B, other=0).to(tl.int64), axis=0)
        # tokens per KV head, rounded half to even as Python's round()
        n = steady * H + n_exact
        quo = n // H
        twice = 2 * (n - quo * H)
        quo += tl.where((twice > H) | ((twice == H) & (quo % 2 == 1)), 1, 0)
        total = steady + indexed_per_head
        tl.store(stats_ptr + 0, tl.load(stats_ptr + 0) + total.to(tl.float64))
        tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + quo.to(tl.float64))
        tl.store(stats_ptr + 2, tl.load(stats_ptr + 2)
                 + tl.sum(retrieved, axis=0).to(tl.float64))
        tl.store(stats_ptr + 3, tl.load(stats_ptr + 3) + n_est.to(tl.float64))
        tl.store(stats_ptr + 4, tl.load(stats_ptr + 4) + mass)


# bookkeeping: no argument is worth a specialization, and the indexed count and the
# tensors' sizes and addresses change as the layer grows (each change compiled it again)
_STEP_STATS = LazyKernel(_step_stats_kernel, do_not_specialize=(
    "cum_ptr", "cum_stride", "count_ptr", "est_count_ptr", "rows", "parts_ptr", "parts_stride",
    "num_exact", "num_parts", "lse_ptr", "qrows", "steady_ptr", "B", "indexed_per_head", "H",
    "stats_ptr", "x_ptr", "x_numel", "y_ptr", "y_numel", "z_ptr", "z_numel", "finite_ptr"))


def accumulate_step(cum: torch.Tensor, count: torch.Tensor, est_count: torch.Tensor,
                    parts_lse: torch.Tensor, num_exact_parts: int, lse: torch.Tensor,
                    steady_lengths: torch.Tensor, indexed: int, num_kv_heads: int,
                    stats: torch.Tensor, checked: tuple[torch.Tensor, ...] = (),
                    finite: torch.Tensor | None = None) -> None:
    """Add one decode step's stats of a layer to ``stats`` and clear ``finite`` if any of
    ``checked`` holds a NaN or Inf: one Triton launch, no host sync.

    Parameters
    ----------
    cum, count, est_count : torch.Tensor
        The step's zones (:class:`vecstore.executor.wave_state.Zones` fields): ``[rows,
        R + 1]`` running retrieved sizes, ``[rows]`` retrieved and estimated clusters.
    parts_lse : torch.Tensor
        ``[B * Hq, P]`` float32 partial log-sum-exps, the first ``num_exact_parts`` exact.
    lse : torch.Tensor
        ``[B, Hq]`` float32 log-sum-exp of each query row.
    steady_lengths : torch.Tensor
        ``[B]`` steady-zone tokens of each row.
    indexed : int
        The view's indexed tokens over all rows and KV heads.
    num_kv_heads : int
        ``H``: token counts are per KV head.
    stats : torch.Tensor
        ``[5]`` float64 accumulator (tokens total, tokens exact, units retrieved, units
        estimated, estimated mass), updated in place.
    checked : tuple[torch.Tensor, ...]
        Three tensors (``q``, keys, values) to check for NaN/Inf, or none.
    finite : torch.Tensor | None
        ``[]`` int32 flag, set to 0 if a checked value is not finite (never set to 1);
        needed with ``checked``.
    """
    check = bool(checked)
    x, y, z = (t.reshape(-1) for t in checked) if check else (stats,) * 3
    rows, qrows, P = count.numel(), parts_lse.shape[0], parts_lse.shape[1]
    B = steady_lengths.numel()
    longest = max(x.numel(), y.numel(), z.numel()) if check else 0
    grid = (max(1, -(-longest // _FINITE_BLOCK)),)
    _STEP_STATS[grid](
        cum, cum.stride(0), count, est_count, rows,
        parts_lse, parts_lse.stride(0), num_exact_parts, P, lse.reshape(-1), qrows,
        steady_lengths, B, indexed // num_kv_heads, num_kv_heads, stats,
        x, x.numel(), y, y.numel(), z, z.numel(), stats if finite is None else finite,
        ROWS_BLOCK=128, QROWS_BLOCK=128, PARTS_BLOCK=16, B_BLOCK=_pow2(B),
        FINITE_BLOCK=_FINITE_BLOCK, CHECK=check)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
