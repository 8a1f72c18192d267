"""centroid_logits against the float64 reference: the index's ranking logits (centroid plus
radius term), the estimation weights ``logit + log n``, and per-split statistics whose merge
is each head's softmax normaliser."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DTYPES, rel_l2, tolerance

from tests.interpreter import interpreted
from vecstore.executor.sq8 import dequantize, quantize
from vecstore.index.wave import bound_logits
from vecstore.kernels.centroid_logits import centroid_logits


def _check(device: torch.device, rows: int, group: int, dim: int, num_clusters: int,
           dtype: torch.dtype, radius_weight: float, sq8: bool, gen: torch.Generator) -> None:
    q = torch.randn(rows * group, dim, generator=gen).to(dtype)
    centroids = torch.randn(rows, num_clusters, dim, generator=gen)
    radii = torch.rand(rows, num_clusters, generator=gen)
    sizes = torch.randint(0, 6, (rows, num_clusters), generator=gen, dtype=torch.int32)
    code_scales = None
    if sq8:  # int8 codes scored as what they stand for
        centroids, code_scales = quantize(centroids)
        exact = dequantize(centroids, code_scales)
    else:
        centroids = centroids.to(dtype)
        exact = centroids.double()
    scale = dim ** -0.5
    weights = torch.full((rows * group, num_clusters), float("nan"), device=device)
    got = centroid_logits(q.to(device), centroids.to(device), radii.to(device),
                          sizes.to(device), scale, radius_weight, weights,
                          None if code_scales is None else code_scales.to(device))
    qg = q.double().view(1, rows, group, 1, dim)
    rank = bound_logits(qg, exact.double()[None], radii.double()[None], scale, radius_weight)
    plain = bound_logits(qg, exact.double()[None], radii.double()[None], scale, 0.0)
    empty = (sizes <= 0)[:, None, :].expand(rows, group, num_clusters).reshape(rows * group, -1)
    rank = rank.reshape(rows * group, -1).masked_fill(empty, float("-inf"))
    plain = plain.reshape(rows * group, -1) + sizes.double().log().repeat_interleave(group, 0)
    tol = tolerance(dtype, device)
    for name, x, ref in (("rank", got.rank, rank), ("weights", weights, plain)):
        x = x.cpu()
        assert torch.equal(x.isneginf(), ref.isneginf()), f"{name}: empty clusters differ"
        live = ref.isfinite()
        assert rel_l2(x[live], ref[live]) < tol, (name, rel_l2(x[live], ref[live]))
    # the splits' max and sum of exp merge into each head's log-sum-exp of the ranking logits
    pmax, psum = got.pmax.double().cpu(), got.psum.double().cpu()
    lse = torch.logsumexp(torch.where(psum > 0, pmax + psum.log(), float("-inf")), dim=1)
    assert rel_l2(lse, torch.logsumexp(rank, dim=1)) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("radius_weight", [0.0, 0.5])
@interpreted
def test_logits_match_reference(gen, dtype, radius_weight):
    _check(torch.device("cpu"), 3, 4, 64, 300, dtype, radius_weight, False, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@interpreted
def test_int8_codes_score_as_what_they_stand_for(gen, dtype):
    _check(torch.device("cpu"), 2, 3, 32, 300, dtype, 0.5, True, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq8", [False, True])
def test_gpu_logits_llama_shape(gen, dtype, sq8):
    _check(torch.device("cuda"), 16, 4, 128, 8192, dtype, 0.5, sq8, gen)
