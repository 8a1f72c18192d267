"""Clusterer backends agree on the same init, and k-means recovers planted clusters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vecstore.cluster import CLUSTERERS, Clusterer, strided_init
from vecstore.errors import BackendUnavailableError


def _planted(P: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dirs = F.normalize(torch.randn(P, k, 16, generator=gen), dim=-1)
    pick = torch.arange(n) * k // n  # contiguous runs, as positions of real keys are
    x = dirs[:, pick] + 0.02 * torch.randn(P, n, 16, generator=gen)
    return F.normalize(x, dim=-1), pick.expand(P, -1)


def test_torch_kmeans_recovers_planted_clusters():
    x, truth = _planted(3, 120, 6, 0)
    counts = torch.full((3,), 120)
    assign = CLUSTERERS.get("torch")().assign(x, counts, strided_init(x, counts, 6), iters=5)
    for p in range(3):  # same partition up to relabelling
        pairs = set(zip(assign[p].tolist(), truth[p].tolist(), strict=True))
        assert len(pairs) == 6


def test_padding_rows_do_not_move_centroids():
    x, _ = _planted(1, 60, 3, 1)
    counts = torch.tensor([45])
    init = strided_init(x, counts, 3)
    clean = CLUSTERERS.get("torch")().assign(x[:, :45], counts, init, iters=4)
    noisy = x.clone()
    noisy[:, 45:] = F.normalize(torch.randn(1, 15, 16), dim=-1)
    padded = CLUSTERERS.get("torch")().assign(noisy, counts, init, iters=4)
    assert torch.equal(clean[0], padded[0, :45])


def test_faiss_matches_torch_on_the_same_init():
    pytest.importorskip("faiss")
    x, _ = _planted(2, 200, 8, 2)
    counts = torch.tensor([200, 200])
    init = strided_init(x, counts, 8)
    a = CLUSTERERS.get("torch")().assign(x, counts, init, iters=6)
    b = CLUSTERERS.get("faiss")().assign(x, counts, init, iters=6)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", CLUSTERERS.names())
def test_every_clusterer_is_a_clusterer_or_says_what_it_needs(name):
    try:
        c = CLUSTERERS.get(name)()
    except BackendUnavailableError as exc:
        assert "pip install" in str(exc) and "torch" in str(exc)
        return
    assert isinstance(c, Clusterer)


def test_cupy_refuses_cpu_tensors_clearly():
    pytest.importorskip("cupy")
    try:
        c = CLUSTERERS.get("cupy")()
    except BackendUnavailableError:
        pytest.skip("cupy has no CUDA runtime here")
    x, _ = _planted(1, 20, 2, 0)
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        c.assign(x, torch.tensor([20]), x[:, :2], 1)


@pytest.mark.gpu
def test_cupy_and_torch_agree_on_cuda():
    x, _ = _planted(4, 256, 16, 3)
    x = x.cuda()
    counts = torch.full((4,), 256, device="cuda")
    init = strided_init(x, counts, 16)
    a = CLUSTERERS.get("torch")().assign(x, counts, init, iters=6)
    b = CLUSTERERS.get("cupy")().assign(x, counts, init, iters=6)
    assert torch.equal(a.cpu(), b.cpu())
