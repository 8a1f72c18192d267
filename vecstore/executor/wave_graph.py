"""The wave executor's decode step as a CUDA graph: captured once, replayed every step.

A captured step reads its inputs from static tensors: the query is copied in, a
``persistent`` steady zone is read in place, any other is copied into the graph's own. The
graph and its static tensors live in the prepared view (:attr:`PreparedView.graph`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vecstore.executor.base import Steady
from vecstore.executor.wave_state import (
    CapturedStep,
    DecodeResult,
    PreparedView,
    add_step_stats,
)

__all__ = ["Step", "replay"]

Step = Callable[[PreparedView, Steady, torch.Tensor, float, float | None], DecodeResult]
"""A decode step: ``(prep, steady, q [B, Hq, D], scale, softcap)`` to its device outputs."""


def replay(prep: PreparedView, steady: Steady, q: torch.Tensor, scale: float,
           step: Step, softcap: float | None = None) -> DecodeResult:
    """Run ``step`` (:meth:`~vecstore.executor.wave_exec.WaveExecutor.decode`, its scores
    soft-capped by ``softcap``) as a CUDA graph kept in ``prep.graph``, captured once per
    query shape, scale, cap and steady zone: a
    ``persistent`` steady zone is read in place (captured per buffer), any other is copied
    into the graph's own, of a capacity rounded up to 256 rows (so a growing steady zone
    re-captures rarely)."""
    B, H, S, D = steady.keys.shape
    if steady.persistent:
        where: tuple = (steady.keys.data_ptr(), steady.values.data_ptr(),
                        steady.lengths.data_ptr(), S)
    else:
        where = (-(-S // 256) * 256,)
    key = (tuple(q.shape), q.dtype, where, scale, softcap)
    g = prep.graph
    if g is None or g.key != key:
        prep.graph = None  # free the old graph's memory before capturing
        g = prep.graph = _capture(prep, key, q, steady, where, scale, softcap, step)
    g.q.copy_(q)
    if g.steady.keys is not steady.keys:
        g.steady.keys[:, :, :S].copy_(steady.keys)
        g.steady.values[:, :, :S].copy_(steady.values)
    if g.steady.lengths is not steady.lengths:
        g.steady.lengths.copy_(steady.lengths)
    if prep.buffer is not None:
        prep.buffer.begin_step()
    g.graph.replay()
    if prep.buffer is not None:
        prep.buffer.finish_step()
    return g.res


def _capture(prep: PreparedView, key: tuple, q: torch.Tensor, steady: Steady, where: tuple,
             scale: float, softcap: float | None, step: Step) -> CapturedStep:
    B, H, S, D = steady.keys.shape
    if steady.persistent:  # read in place; the graph keeps the buffer alive
        static = steady
    else:
        cap = where[0]
        static = Steady(steady.keys.new_zeros(B, H, cap, D),
                        steady.values.new_zeros(B, H, cap, D), steady.lengths.clone())
        static.keys[:, :, :S].copy_(steady.keys)
        static.values[:, :, :S].copy_(steady.values)
    qs = q.contiguous().clone()
    warm = torch.cuda.Stream(q.device)
    warm.wait_stream(torch.cuda.current_stream(q.device))
    H = prep.sizes.shape[0] // B
    with torch.cuda.stream(warm):  # compiles the kernels; a real step for the buffer
        if prep.buffer is not None:
            prep.buffer.begin_step()
        _stats(step(prep, static, qs, scale, softcap), static, prep.tokens_total, H)
        if prep.buffer is not None:
            prep.buffer.finish_step()
    torch.cuda.current_stream(q.device).wait_stream(warm)
    if prep.buffer is not None:
        prep.buffer.bookkeeper.wait()
    graph = torch.cuda.CUDAGraph()
    # thread_local: the policy worker may touch CUDA (events, pinned copies) meanwhile
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        res = step(prep, static, qs, scale, softcap)
        stats = _stats(res, static, prep.tokens_total, H)
    return CapturedStep(key=key, graph=graph, q=qs, steady=static, res=res, stats=stats)


def _stats(res: DecodeResult, steady: Steady, indexed: int, H: int) -> torch.Tensor:
    """:func:`~vecstore.executor.wave_state.step_stats` in two launches (a zeroed
    accumulator and one Triton kernel) instead of some twenty small ones."""
    stats = torch.zeros(5, dtype=torch.float64, device=res.lse.device)
    add_step_stats(res, steady.lengths, indexed, H, stats)
    return stats
