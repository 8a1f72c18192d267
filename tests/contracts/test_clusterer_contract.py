"""The :class:`~vecstore.cluster.Clusterer` contract, for every backend in ``CLUSTERERS``.

A backend either builds, or raises :class:`BackendUnavailableError` saying what to install.
One that builds runs on CUDA tensors where a GPU is present, on CPU tensors otherwise
(refusing them with :class:`BackendUnavailableError` is allowed, saying so).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.reference import planted_clusters
from vecstore.cluster import CLUSTERERS, Clusterer, strided_init
from vecstore.errors import BackendUnavailableError

NAMES = CLUSTERERS.names()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _build(name: str) -> Clusterer:
    """The backend, or a skip naming what it lacks."""
    try:
        clusterer = CLUSTERERS.get(name)(seed=0)
    except BackendUnavailableError as exc:
        assert "pip install" in str(exc) and "'torch'" in str(exc)
        pytest.skip(str(exc))
    assert isinstance(clusterer, Clusterer)
    return clusterer  # type: ignore[no-any-return]


def _assign(name: str, x: torch.Tensor, counts: torch.Tensor, init: torch.Tensor,
            iters: int) -> torch.Tensor:
    clusterer = _build(name)
    x, counts, init = x.to(DEVICE), counts.to(DEVICE), init.to(DEVICE)
    try:
        out = clusterer.assign(x, counts, init, iters)
    except BackendUnavailableError as exc:
        assert DEVICE in str(exc) or "CUDA" in str(exc)
        pytest.skip(str(exc))
    assert out.shape == x.shape[:2] and out.dtype == torch.int64 and out.device == x.device
    return out.cpu()


@pytest.mark.parametrize("name", NAMES)
def test_builds_or_says_what_it_needs(name: str) -> None:
    _build(name)


@pytest.mark.parametrize("name", NAMES)
def test_recovers_planted_clusters_with_the_requested_count(name: str) -> None:
    x, truth = planted_clusters(3, 120, 6, 0)
    counts = torch.full((3,), 120)
    assign = _assign(name, x, counts, strided_init(x, counts, 6), iters=5)
    for p in range(3):  # the same partition up to relabelling: 6 clusters, each one group
        pairs = set(zip(assign[p].tolist(), truth[p].tolist(), strict=True))
        assert len(pairs) == 6 and {a for a, _ in pairs} == set(range(6))


@pytest.mark.parametrize("name", NAMES)
def test_no_iterations_assign_each_point_to_its_nearest_initial_centroid(name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = F.normalize(torch.randn(2, 50, 8, generator=gen), dim=-1)
    init = F.normalize(torch.randn(2, 5, 8, generator=gen), dim=-1)
    assign = _assign(name, x, torch.tensor([50, 50]), init, iters=0)
    assert torch.equal(assign, torch.bmm(x, init.transpose(1, 2)).argmax(-1))


@pytest.mark.parametrize("name", NAMES)
def test_every_valid_point_gets_a_cluster_and_padding_moves_none(name: str) -> None:
    x, _ = planted_clusters(2, 60, 3, 2)
    counts = torch.tensor([45, 60])
    init = strided_init(x, counts, 3)
    clean = _assign(name, x, counts, init, iters=4)
    noisy = x.clone()
    noisy[0, 45:] = F.normalize(torch.randn(15, 16, generator=torch.Generator().manual_seed(3)),
                                dim=-1)
    padded = _assign(name, noisy, counts, init, iters=4)
    assert torch.equal(clean[0, :45], padded[0, :45]) and torch.equal(clean[1], padded[1])
    assert ((clean >= 0) & (clean < 3))[0, :45].all() and ((clean >= 0) & (clean < 3))[1].all()
