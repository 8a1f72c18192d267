"""select_zones and select_ranked: the zones are those of a stable top-k of the ranking score
(the float64 group softmax of the index's ranking logits, for select_ranked), on every radix
path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.interpreter import interpreted
from vecstore.index.pages import group_softmax_rank
from vecstore.kernels import radix_select, zone_write
from vecstore.kernels.centroid_logits import Logits
from vecstore.kernels.zone_select import select_ranked, select_zones
from vecstore.kernels.zones import Zones


@pytest.mark.parametrize(("row_radix_max", "cand_fraction"), [(1 << 20, 8), (0, 8), (0, 1000)],
                         ids=["row-programs", "candidates", "candidates-overflow"])
@interpreted
def test_select_zones_is_a_stable_top_k(monkeypatch, row_radix_max, cand_fraction):
    monkeypatch.setattr(radix_select, "_ROW_RADIX_MAX", row_radix_max)
    # lists of 312 candidates overflow only where many scores tie (row 3, row 4 at k2);
    # lists of 2 overflow nearly everywhere
    monkeypatch.setattr(radix_select, "_CAND_FRACTION", cand_fraction)

    gen = torch.Generator().manual_seed(0)
    rows, C = 6, 2500  # three chunks of 1024
    score = torch.rand(rows, C, generator=gen)
    score[5] = torch.randn(C, generator=gen) * torch.randn(C, generator=gen).exp2()  # any sign
    score[0, :10] = score[0, 10]  # ties across the retrieval threshold
    score[1, 1000:] = float("-inf")
    score[3] = 0.5  # all tied: chunk 0 taken whole, chunk 1 in part
    score[4, ::2] = 0.25  # ties split across chunks at both thresholds
    sizes = torch.randint(1, 30, (rows, C), generator=gen, dtype=torch.int32)
    sizes[1, 1000:] = 0
    sizes[3, 1030:1040] = 0  # empty clusters among the ties are skipped
    first = (torch.cumsum(sizes, 1) - sizes).int()
    k1 = torch.tensor([45, 36, 0, 1100, 700, 300], dtype=torch.int32)
    k2 = torch.tensor([600, 500, 7, 2000, 1300, 1500], dtype=torch.int32)
    z = Zones.empty(rows, C, 1100, torch.device("cpu"), e_max=1200)
    select_zones(score, sizes, first, k1, k2, z)
    _check_stable_top_k(score, sizes, first, k1, k2, z)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
@interpreted
def test_select_zones_is_a_stable_top_k_for_any_scores(data):
    # random rows over a few distinct scores (many ties), empty clusters, any k1 <= k2;
    # small chunks and walks so every path runs on a few hundred clusters: row programs
    # over the whole row or over lists of their own from any pass, and candidate lists
    # that fit, or overflow
    rows = data.draw(st.integers(1, 3))
    C = data.draw(st.integers(1, 300))
    values = st.sampled_from([0.0, 0.5, 0.25, 1e-3, 7.0, -2.0, float("-inf")])
    score = torch.tensor(data.draw(st.lists(values, min_size=rows * C, max_size=rows * C)),
                         dtype=torch.float32).reshape(rows, C)
    score += torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.0, 1e-4, 3e-5]),
                                             min_size=rows * C, max_size=rows * C))
                          ).reshape(rows, C)
    sizes = torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=rows * C,
                                            max_size=rows * C)), dtype=torch.int32)
    sizes = sizes.reshape(rows, C)
    first = (torch.cumsum(sizes, 1) - sizes).int()
    k2 = torch.tensor([data.draw(st.integers(0, C)) for _ in range(rows)], dtype=torch.int32)
    k1 = torch.tensor([data.draw(st.integers(0, int(k))) for k in k2], dtype=torch.int32)
    patch = {(radix_select, "_ROW_RADIX_MAX"): data.draw(st.sampled_from([0, 1 << 20])),
             (radix_select, "_ROW_COMPACT_AT"): data.draw(st.sampled_from([0, 1, 2, 4])),
             (radix_select, "_CAND_FRACTION"): data.draw(st.sampled_from([1, 4, 1000])),
             (zone_write, "_SELECT_BLOCK"): 64, (radix_select, "_RADIX_BLOCK"): 64,
             (radix_select, "_LIST_BLOCK"): 16}
    saved = {(m, k): getattr(m, k) for m, k in patch}
    try:
        for (m, k), v in patch.items():
            setattr(m, k, v)
        z = Zones.empty(rows, C, max(1, int(k1.max())), torch.device("cpu"),
                        e_max=max(1, C))
        select_zones(score, sizes, first, k1, k2, z)
    finally:
        for (m, k), v in saved.items():
            setattr(m, k, v)
    _check_stable_top_k(score, sizes, first, k1, k2, z)


def _check_stable_top_k(score, sizes, first, k1, k2, z):
    # the zones of a stable top-k: ranks by score, ties by cluster id, empty clusters skipped
    score, sizes, first = score.cpu(), sizes.cpu(), first.cpu()
    for r in range(score.shape[0]):
        order = torch.sort(-score[r], stable=True).indices
        real = sizes[r] > 0
        ret = sorted(i for i in order[:k1[r]].tolist() if real[i])
        est = sorted(i for i in order[k1[r]:k2[r]].tolist() if real[i])
        n = int(z.count[r])
        assert sorted(z.ids[r, :n].tolist()) == ret
        assert (z.zone[r] == 2).nonzero().flatten().tolist() == est
        assert z.est_ids[r, :int(z.est_count[r])].tolist() == est
        assert z.cum[r, :n + 1].tolist() == [0, *torch.cumsum(sizes[r, ret], 0).tolist()]
        assert z.first_row[r, :n].tolist() == first[r, ret].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("row_radix_max", [1 << 20, 0], ids=["row-programs", "candidates"])
def test_gpu_select_zones_is_a_stable_top_k(monkeypatch, row_radix_max):
    # compiled kernels: rows long enough for the candidate lists, ties at both thresholds
    monkeypatch.setattr(radix_select, "_ROW_RADIX_MAX", row_radix_max)
    gen = torch.Generator().manual_seed(8)
    rows, C = 4, 40000
    score = torch.rand(rows, C, generator=gen) ** 4
    score[1, ::3] = score[1, 7]  # a third of the row tied
    score[2, :20000] = float("-inf")
    sizes = torch.randint(0, 30, (rows, C), generator=gen, dtype=torch.int32)
    first = (torch.cumsum(sizes, 1) - sizes).int()
    k1 = torch.tensor([700, 5000, 300, 1], dtype=torch.int32)
    k2 = torch.tensor([9000, 14000, 19000, 40000], dtype=torch.int32)
    dev = torch.device("cuda")
    z = Zones.empty(rows, C, 5000, dev, e_max=40000)
    select_zones(score.to(dev), sizes.to(dev), first.to(dev), k1.to(dev), k2.to(dev), z)
    _check_stable_top_k(score, sizes, first, k1, k2, Zones(*(t.cpu() for t in (
        z.zone, z.ids, z.first_row, z.cum, z.count, z.est_ids, z.est_count))))


def _check_ranked(device: torch.device, rows: int, group: int, num_clusters: int,
                  num_splits: int, gen: torch.Generator) -> None:
    sizes = torch.randint(0, 6, (rows, num_clusters), generator=gen, dtype=torch.int32)
    first = (torch.cumsum(sizes, 1) - sizes).int()
    # clusters share one of 50 logit columns per row: many exact ties (broken by id in the
    # kernel and the reference alike); rows whose distinct scores come within 1e-4 of each
    # other (relative) are drawn again, so the GPU's approximate exp cannot reorder them
    pick = torch.randint(0, 50, (rows, num_clusters), generator=gen)
    empty = (sizes <= 0).repeat_interleave(group, 0)
    patterns = 3 * torch.randn(rows * group, 50, generator=gen)
    for _ in range(50):
        rank = patterns.gather(1, pick.repeat_interleave(group, 0)).masked_fill(
            empty, float("-inf"))
        score = group_softmax_rank(rank.double().view(1, rows, group, 1, num_clusters),
                                   sizes[None])[0]
        close = torch.tensor([_min_gap(row) < 1e-4 for row in score])
        if not close.any():
            break
        redraw = close.repeat_interleave(group)
        patterns[redraw] = 3 * torch.randn(int(redraw.sum()), 50, generator=gen)
    assert not close.any()
    # each split's max and sum of exp, as centroid_logits writes them
    pmax = torch.empty(rows * group, num_splits)
    psum = torch.empty(rows * group, num_splits)
    for s, chunk in enumerate(rank.tensor_split(num_splits, dim=1)):
        m = chunk.amax(1)
        pmax[:, s] = m
        safe = torch.where(m.isneginf(), 0.0, m)
        psum[:, s] = torch.exp(chunk - safe[:, None]).sum(1)
    k2 = torch.randint(0, num_clusters + 1, (rows,), generator=gen, dtype=torch.int32)
    k1 = (k2 * torch.rand(rows, generator=gen)).int()
    z = Zones.empty(rows, num_clusters, max(1, int(k1.max())), device, e_max=num_clusters)
    select_ranked(Logits(rank.to(device), pmax.to(device), psum.to(device)), sizes.to(device),
                  first.to(device), k1.to(device), k2.to(device), z)
    _check_stable_top_k(score, sizes, first, k1, k2, Zones(*(t.cpu() for t in (
        z.zone, z.ids, z.first_row, z.cum, z.count, z.est_ids, z.est_count))))


def _min_gap(scores: torch.Tensor) -> float:
    """The smallest relative gap between distinct finite ``scores`` (inf if fewer than 2)."""
    u = torch.unique(scores[scores.isfinite()])
    return float(((u[1:] - u[:-1]) / u[1:].abs()).min()) if u.numel() > 1 else float("inf")


@pytest.mark.parametrize("compact_at", [0, 1, 2], ids=["whole-rows", "list-at-1", "list-at-2"])
@interpreted
def test_select_ranked_takes_the_top_of_the_group_softmax(monkeypatch, gen, compact_at):
    # the radix passes after the score kernel's first: over the whole row, or over a row
    # program's own list from pass 1 or 2
    monkeypatch.setattr(radix_select, "_ROW_COMPACT_AT", compact_at)
    _check_ranked(torch.device("cpu"), 4, 3, 700, 3, gen)


@pytest.mark.gpu
def test_gpu_select_ranked_llama_shape(gen):
    _check_ranked(torch.device("cuda"), 64, 4, 8192, 40, gen)
