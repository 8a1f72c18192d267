"""nearest_centroid: the k-means assignment kernel against bmm + argmax in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter import interpreted
from vecstore.kernels.nearest_centroid import nearest_centroid


def _scores(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.double(), c.double().transpose(1, 2))


@pytest.mark.parametrize(("P", "n", "k", "D"), [(3, 100, 70, 32), (2, 64, 64, 16),
                                                (1, 1, 1, 16), (2, 130, 200, 64)])
@interpreted
def test_nearest_centroid_is_the_argmax_of_the_inner_products(gen, P, n, k, D):
    x = F.normalize(torch.randn(P, n, D, generator=gen), dim=-1)
    c = F.normalize(torch.randn(P, k, D, generator=gen), dim=-1)
    got = nearest_centroid(x, c)
    scores = _scores(x, c)
    assert got.shape == (P, n) and got.dtype == torch.int64
    assert torch.equal(got, scores.argmax(-1))


@interpreted
def test_nearest_centroid_breaks_ties_towards_the_lower_id(gen):
    # distinct +-1 centroids: every inner product is a small integer, exact in any summation
    # order, so a tie is a tie however the dots are tiled (random floats tied or not by
    # their last bit, as the BLAS under the interpreter summed them)
    D, k = 16, 150
    signs = torch.randint(0, 2, (4 * k, D), generator=gen).unique(dim=0)
    c = (2.0 * signs[torch.randperm(signs.shape[0], generator=gen)[:k]] - 1.0)[None]
    c[0, 5] = c[0, 3]  # a tie within a tile of centroids
    c[0, 140] = c[0, 70]  # and one across tiles (64 a tile)
    x = torch.stack([c[0, 3], c[0, 70], c[0, 140]])[None]
    assert torch.equal(_scores(x, c).max(-1).values, torch.full((1, 3), float(D),
                                                                dtype=torch.float64))
    assert nearest_centroid(x, c).tolist() == [[3, 70, 70]]


@pytest.mark.gpu
def test_gpu_nearest_centroid_picks_a_best_centroid_to_tf32_precision(gen):
    P, n, k, D = 16, 8192, 512, 128
    x = F.normalize(torch.randn(P, n, D, generator=gen), dim=-1).cuda()
    c = F.normalize(torch.randn(P, k, D, generator=gen), dim=-1).cuda()
    got = nearest_centroid(x, c)
    scores = _scores(x, c)
    best = scores.max(-1).values
    chosen = scores.gather(-1, got[..., None])[..., 0]
    assert float((best - chosen).max()) < 2e-3  # TF32 operands: 10 significant bits
    assert float((got == scores.argmax(-1)).double().mean()) > 0.99
