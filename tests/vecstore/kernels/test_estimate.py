"""estimate_zone against the float64 definition, on both backends."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DTYPES, SHAPES, TOLERANCE, assert_state_close, poisoned, ref_estimate

from vecstore.errors import ShapeError
from vecstore.kernels import estimate_zone


def _inputs(batch, num_kv, group, dim, num_clusters, num_ids, dtype, gen):
    logits = 2.0 * torch.randn(batch, num_kv * group, num_clusters, generator=gen)
    sizes = torch.randint(0, 20, (batch, num_kv, num_clusters), generator=gen)
    value_sums = sizes[..., None] * torch.randn(batch, num_kv, num_clusters, dim, generator=gen)
    value_sums[sizes == 0] = float("nan")  # padding clusters may hold anything
    perm = torch.argsort(torch.rand(batch, num_kv, num_clusters, generator=gen), dim=-1)
    est_ids = perm[..., :num_ids].clone()
    est_ids[torch.rand(est_ids.shape, generator=gen) < 0.15] = -1  # scattered padding
    return logits, sizes, value_sums.to(dtype), est_ids


def _run(target, logits, sizes, value_sums, est_ids, **kwargs):
    dev = [t.to(target.device) for t in (logits, sizes, value_sums, est_ids)]
    return estimate_zone(*dev, backend=target.backend, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(target, gen, shape, dtype):
    batch, num_kv, group, dim = shape
    inputs = _inputs(batch, num_kv, group, dim, 90, 71, dtype, gen)
    out = poisoned(
        ((batch, num_kv * group, dim), torch.float32),
        ((batch, num_kv * group), torch.float32),
        device=target.device,
    )
    result, lse = _run(target, *inputs, out=out)
    assert result is out[0] and lse is out[1]
    assert_state_close(result, lse, *ref_estimate(*inputs), TOLERANCE[dtype])


def test_rows_without_valid_clusters(target, gen):
    logits, sizes, value_sums, est_ids = _inputs(2, 2, 3, 64, 50, 41, torch.bfloat16, gen)
    est_ids[0, 0] = -1  # only padding
    sizes[1, 1] = 0  # only empty clusters
    est_ids[1, 0, :] = torch.arange(50, 91)  # only ids past C
    value_sums[sizes == 0] = float("nan")
    result, lse = _run(target, logits, sizes, value_sums, est_ids)
    ref_out, ref_lse = ref_estimate(logits, sizes, value_sums, est_ids)
    assert torch.isneginf(ref_lse[0, :3]).all() and torch.isneginf(ref_lse[1]).all()
    assert_state_close(result, lse, ref_out, ref_lse, TOLERANCE[torch.bfloat16])


def test_no_ids(target, gen):
    logits, sizes, value_sums, _ = _inputs(1, 2, 4, 64, 30, 5, torch.float16, gen)
    result, lse = _run(target, logits, sizes, value_sums, torch.empty(1, 2, 0, dtype=torch.long))
    assert torch.isneginf(lse).all() and torch.all(result == 0)


def test_rejects_bad_shapes():
    logits = torch.randn(1, 4, 6)
    sizes = torch.ones(1, 2, 6, dtype=torch.int32)
    value_sums = torch.randn(1, 2, 6, 8)
    ids = torch.zeros(1, 2, 3, dtype=torch.long)
    with pytest.raises(ShapeError):
        estimate_zone(logits.half(), sizes, value_sums, ids)  # logits must be float32
    with pytest.raises(ShapeError):
        estimate_zone(logits, sizes, value_sums[:, :1], ids)
    with pytest.raises(ShapeError):
        estimate_zone(logits, sizes, value_sums, ids.float())
    with pytest.raises(ShapeError):
        estimate_zone(logits, sizes, value_sums, ids, out=(torch.empty(1, 4, 8), None))
