"""attend_steady against the float64 reference: exact attention over each sequence's steady
rows, one partial state per split."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DTYPES, assert_state_close, empty_parts, merged_parts, tolerance

from tests.interpreter import interpreted
from vecstore.kernels.reference import attend
from vecstore.kernels.steady_attention import STEADY_SPLIT, attend_steady, steady_splits


def _check(device: torch.device, batch: int, heads: int, group: int, dim: int, capacity: int,
           lengths: list[int], dtype: torch.dtype, gen: torch.Generator) -> None:
    q = torch.randn(batch * heads * group, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, heads, capacity, dim, generator=gen).to(dtype)
    values = torch.randn(batch, heads, capacity, dim, generator=gen).to(dtype)
    valid = torch.arange(capacity) < torch.tensor(lengths)[:, None, None]  # [B, 1, S]
    keys[~valid.expand_as(keys[..., 0])] = float("nan")  # rows past a length are never read
    values[~valid.expand_as(values[..., 0])] = float("nan")
    base, splits = 1, steady_splits(capacity)
    parts = empty_parts(q.shape[0], base + splits, dim, device)
    attend_steady(q.to(device), keys.to(device), values.to(device),
                  torch.tensor(lengths).to(device), dim ** -0.5, parts, base)
    assert parts[1][:, :base].isnan().all()  # parts before split_base are left alone
    out, lse = merged_parts(parts, base, base + splits)
    valid = valid.expand(batch, heads, capacity)
    ref = attend(q.double().view(batch, heads, group, 1, dim), keys.double().nan_to_num(),
                 values.double().nan_to_num(), valid, dim ** -0.5)
    assert_state_close(out, lse, *ref, tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@interpreted
def test_steady_zone_matches_reference(gen, dtype):
    # several splits, a partial last block, a single row and an empty sequence
    _check(torch.device("cpu"), 3, 2, 3, 64, STEADY_SPLIT + 70, [STEADY_SPLIT + 70, 1, 0],
           dtype, gen)


@interpreted
def test_steady_zone_of_one_split(gen):
    _check(torch.device("cpu"), 1, 1, 4, 32, 50, [37], torch.float32, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_steady_zone_llama_shape(gen, dtype):
    _check(torch.device("cuda"), 4, 8, 4, 128, 1100, [1100, 68, 0, 513], dtype, gen)
