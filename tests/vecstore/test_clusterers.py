"""Clusterer backends agree on the same init; the contract every backend keeps is in
``tests/contracts/test_clusterer_contract.py``."""

from __future__ import annotations

import pytest
import torch

from tests.reference import planted_clusters
from vecstore.cluster import CLUSTERERS, strided_init
from vecstore.errors import BackendUnavailableError


def test_faiss_matches_torch_on_the_same_init():
    pytest.importorskip("faiss")
    x, _ = planted_clusters(2, 200, 8, 2)
    counts = torch.tensor([200, 200])
    init = strided_init(x, counts, 8)
    a = CLUSTERERS.get("torch")().assign(x, counts, init, iters=6)
    b = CLUSTERERS.get("faiss")().assign(x, counts, init, iters=6)
    assert torch.equal(a, b)


def test_cupy_refuses_cpu_tensors_clearly():
    pytest.importorskip("cupy")
    try:
        c = CLUSTERERS.get("cupy")()
    except BackendUnavailableError:
        pytest.skip("cupy has no CUDA runtime here")
    x, _ = planted_clusters(1, 20, 2, 0)
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        c.assign(x, torch.tensor([20]), x[:, :2], 1)


@pytest.mark.gpu
def test_cupy_and_torch_agree_on_cuda():
    x, _ = planted_clusters(4, 256, 16, 3)
    x = x.cuda()
    counts = torch.full((4,), 256, device="cuda")
    init = strided_init(x, counts, 16)
    a = CLUSTERERS.get("torch")().assign(x, counts, init, iters=6)
    b = CLUSTERERS.get("cupy")().assign(x, counts, init, iters=6)
    assert torch.equal(a.cpu(), b.cpu())


def test_torch_assignment_breaks_ties_towards_the_lower_centroid_on_the_cpu():
    from vecstore.cluster.torch_kmeans import _nearest_by_bmm

    c = torch.nn.functional.normalize(torch.randn(1, 6, 8, generator=torch.Generator()
                                                  .manual_seed(0)), dim=-1)
    c[0, 4] = c[0, 1]  # a duplicate centroid: its points go to the lower id
    assert _nearest_by_bmm(c[:, [1, 4, 5]] * 3.0, c).tolist() == [[1, 1, 5]]


@pytest.mark.parametrize("block", [1, 50, 1 << 20])  # a point a block, a few, one block
def test_cpu_assignment_in_blocks_of_points_equals_the_whole_score_matrix(block, monkeypatch):
    from vecstore.cluster import torch_kmeans

    monkeypatch.setattr(torch_kmeans, "_CPU_BLOCK_ELEMENTS", block)
    gen = torch.Generator().manual_seed(3)
    x = torch.nn.functional.normalize(torch.randn(3, 37, 8, generator=gen), dim=-1)
    c = torch.nn.functional.normalize(torch.randn(3, 5, 8, generator=gen), dim=-1)
    want = torch.einsum("pnd,pkd->pnk", x.double(), c.double()).argmax(-1)
    assert torch.equal(torch_kmeans._nearest_by_bmm(x, c), want)
