"""The fused stats-and-NaN kernel of a captured decode step equals its torch form."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from tests.interpreter import interpreted, request_interpreter
from vecstore.config import StoreConfig
from vecstore.executor.base import Steady
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.executor.wave_state import step_stats
from vecstore.index.base import IndexView
from vecstore.index.wave import WaveIndex

request_interpreter()  # the kernel runs on CPU tensors in Triton's interpreter

CFG = StoreConfig.from_dict({"index": {"segment_tokens": 256},
                             "attention": {"retrieval_budget": 0.1, "estimation_budget": 0.3}})
H, D, G = 2, 16, 2


def _step(gen: torch.Generator):
    """A real decode step of the wave executor over three rows of different lengths."""
    index = WaveIndex(CFG)
    views = []
    for n in (900, 500, 700):
        k, v = torch.randn(2, H, n, D, generator=gen)
        views.append(IndexView.from_segments(index.build(k, v, 4)))
    view = IndexView.stack(views)
    B, S = 3, 40
    steady = Steady(torch.randn(B, H, S, D, generator=gen), torch.randn(B, H, S, D, generator=gen),
                    torch.tensor([40, 17, 29]))
    q = torch.randn(B, H * G, D, generator=gen)
    ex = WaveExecutor(backend="triton", score_dtype=torch.float32, use_graphs=False)
    prep = ex.prepare(view, CFG.for_layer(0), index)
    return ex.decode(prep, steady, q, D ** -0.5), steady, prep, q


@pytest.mark.parametrize("bad", [None, "nan", "inf"])
@interpreted
def test_fused_step_stats_equal_torch(bad):
    from vecstore.kernels.step_stats import accumulate_step

    gen = torch.Generator().manual_seed(3)
    res, steady, prep, q = _step(gen)
    k, v = torch.randn(3, H, 1, D, generator=gen), torch.randn(3, H, 1, D, generator=gen)
    if bad is not None:
        v[1, 0, 0, 5] = float(bad)
    want = step_stats(res, steady.lengths, prep.tokens_total, H)
    start = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5], dtype=torch.float64)
    stats, finite = start.clone(), torch.ones((), dtype=torch.int32)
    z = res.zones
    accumulate_step(z.cum, z.count, z.est_count, res.parts_lse, res.num_exact_parts, res.lse,
                    steady.lengths, prep.tokens_total, H, stats, (q, k, v), finite)
    assert want[3] > 0 and 0 < want[4] < 1  # some mass was estimated: the share is checked
    torch.testing.assert_close(stats[:4], start[:4] + want[:4], rtol=0, atol=0)
    torch.testing.assert_close(stats[4], start[4] + want[4], rtol=1e-5, atol=1e-7)
    assert int(finite) == (bad is None)


@interpreted
def test_fused_check_sees_a_bad_value_past_the_first_block():
    from vecstore.kernels import step_stats as module

    gen = torch.Generator().manual_seed(4)
    res, steady, prep, _ = _step(gen)
    q = torch.randn(module._FINITE_BLOCK * 2 + 7)  # three blocks of q
    k = v = torch.zeros(4)
    z = res.zones
    for at, ok in ((module._FINITE_BLOCK * 2 + 6, 0), (None, 1)):
        x = q.clone()
        if at is not None:
            x[at] = float("-inf")
        finite = torch.ones((), dtype=torch.int32)
        module.accumulate_step(z.cum, z.count, z.est_count, res.parts_lse,
                               res.num_exact_parts, res.lse, steady.lengths,
                               prep.tokens_total, H, torch.zeros(5, dtype=torch.float64),
                               (x, k, v), finite)
        assert int(finite) == ok


def test_the_stats_kernel_specializes_on_none_of_its_arguments():
    # Triton compiles a kernel again for every new specialization of its arguments (an int
    # being 1 or a multiple of 16, a pointer's alignment); the indexed count, sizes and
    # addresses change as a layer grows, and each change cost a fresh H200 0.5-0.8 s of a
    # decode step (benchmarks/flush_steps.py's compile log)
    from vecstore.kernels.step_stats import _STEP_STATS, _step_stats_kernel

    params = inspect.signature(_step_stats_kernel).parameters
    runtime = {name for name, p in params.items() if p.annotation != "tl.constexpr"}
    assert set(_STEP_STATS._plain) == runtime


@interpreted
def test_the_estimated_share_runs_over_parts_block_by_block():
    # more estimated parts than one PARTS_BLOCK, spread over several magnitudes, one row
    # with none finite: the running max and mass give the log-sum-exp of all of them
    from vecstore.kernels.step_stats import accumulate_step

    gen = torch.Generator().manual_seed(5)
    res, steady, prep, _ = _step(gen)
    rows = res.parts_lse.shape[0]
    parts = torch.randn(rows, 45, generator=gen) * 8.0
    parts[:, 30:] -= 40.0  # a later block far below the first
    parts[0, 5:] = float("-inf")
    parts[1, 40] = 30.0  # the largest part in the last block
    res = replace(res, parts_lse=parts, num_exact_parts=5,
                  lse=torch.logsumexp(parts, dim=1).view_as(res.lse) + 0.5)
    want = step_stats(res, steady.lengths, prep.tokens_total, H)
    stats = torch.zeros(5, dtype=torch.float64)
    z = res.zones
    accumulate_step(z.cum, z.count, z.est_count, res.parts_lse, res.num_exact_parts, res.lse,
                    steady.lengths, prep.tokens_total, H, stats)
    assert 0 < want[4] < 1
    torch.testing.assert_close(stats[4], want[4], rtol=1e-5, atol=1e-7)
