"""attend_estimated against the float64 reference: the estimated clusters' attention state
from their log weights ``s q . c_j + log n_j`` and value means."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import (
    DTYPES,
    assert_state_close,
    clustered,
    empty_parts,
    make_zones,
    merged_parts,
    on,
    tolerance,
)

from tests.interpreter import interpreted
from vecstore.kernels import estimated_attention
from vecstore.kernels.estimated_attention import attend_estimated, estimate_layout
from vecstore.kernels.reference import estimate


def _check(device: torch.device, rows: int, group: int, dim: int, num_clusters: int,
           picks: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    sizes, first = clustered(rows, num_clusters, 9, gen)
    q = torch.randn(rows * group, dim, generator=gen, dtype=torch.float64)
    centroids = torch.randn(rows, num_clusters, dim, generator=gen, dtype=torch.float64)
    vmean = torch.randn(rows, num_clusters, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    logits = scale * torch.einsum("rgd,rcd->rgc", q.view(rows, group, dim), centroids)
    n = sizes.double()[:, None]
    weights = (logits + n.log()).float().reshape(rows * group, num_clusters)  # -inf if empty
    picked = [torch.randperm(num_clusters, generator=gen)[:picks].tolist() for _ in range(rows)]
    picked[0] = []  # a row with nothing to estimate
    for r in range(1, rows):  # estimated clusters are never empty
        picked[r] = [c for c in picked[r] if sizes[r, c] > 0]
    vmean[sizes == 0] = float("nan")  # clusters not estimated are never read
    zones = make_zones(sizes, first, [[] for _ in range(rows)], picked, 1, max(1, picks))
    base, (_, splits) = 2, estimate_layout(max(1, picks))
    parts = empty_parts(rows * group, base + splits, dim, device)
    attend_estimated(weights.to(device), vmean.to(device), on(zones, device), parts, base)
    out, lse = merged_parts(parts, base, base + splits)
    ids = zones.est_ids.long()  # [rows, E], -1 pads
    safe = ids.clamp_min(0)
    gather = safe[..., None].expand(-1, -1, dim)
    log_n = torch.where(ids >= 0, sizes.gather(1, safe).double().log(), float("-inf"))
    ref = estimate(q.view(rows, 1, group, 1, dim), centroids.gather(1, gather)[:, None],
                   log_n[:, None], vmean.double().nan_to_num().gather(1, gather)[:, None],
                   scale)
    assert_state_close(out, lse, *ref, tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@interpreted
def test_estimated_zone_matches_reference(gen, dtype):
    _check(torch.device("cpu"), 3, 3, 64, 120, 70, dtype, gen)


@interpreted
def test_estimated_zone_in_several_splits(monkeypatch, gen):
    monkeypatch.setattr(estimated_attention, "ESTIMATE_SPLIT", 16)
    monkeypatch.setattr(estimated_attention, "_BLOCK_E", 16)
    assert estimate_layout(70)[1] > 1
    _check(torch.device("cpu"), 2, 4, 32, 90, 70, torch.float32, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_estimated_zone_llama_shape(gen, dtype):
    _check(torch.device("cuda"), 16, 4, 128, 4096, 1000, dtype, gen)
