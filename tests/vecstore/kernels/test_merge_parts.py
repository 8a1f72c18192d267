"""combine against the float64 log-sum-exp merge of every partial state of a query row."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import merged_parts

from tests.interpreter import interpreted
from vecstore.kernels import merge_parts
from vecstore.kernels.merge_parts import combine


def _check(device: torch.device, rows: int, num_parts: int, dim: int,
           out_dtype: torch.dtype, gen: torch.Generator) -> None:
    out_p = torch.randn(rows, num_parts, dim, generator=gen)
    lse_p = torch.randn(rows, num_parts, generator=gen) * 4
    lse_p[0] = float("-inf")  # a row without any state
    lse_p[1, 5:] = float("-inf")
    out = torch.empty(rows, dim, dtype=out_dtype, device=device)
    lse = torch.empty(rows, device=device)
    combine((out_p.to(device), lse_p.to(device)), out, lse)
    ref_out, ref_lse = merged_parts((out_p, lse_p), 0, num_parts)
    atol = 1e-6 if out_dtype in (torch.float32, torch.float64) else 2e-2  # out rounded
    assert torch.allclose(out.double().cpu(), ref_out, atol=atol)
    assert torch.allclose(lse[1:].double().cpu(), ref_lse[1:], atol=1e-5)
    assert lse[0] == float("-inf") and not out[0].any()


@pytest.mark.parametrize(("dims", "block"), [(128, 16), (16, 16), (32, 64)])
@interpreted
def test_combine_merges_partial_states_by_log_sum_exp(monkeypatch, gen, dims, block):
    monkeypatch.setattr(merge_parts, "_COMBINE_DIMS", dims)
    monkeypatch.setattr(merge_parts, "_COMBINE_BLOCK", block)
    _check(torch.device("cpu"), 5, 37, 64, torch.float64, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_combine_llama_shape(gen, out_dtype):
    _check(torch.device("cuda"), 8 * 32, 300, 128, out_dtype, gen)
