"""The fused CPU step (Numba) equals the torch reference, selects zones as a stable sort
does, and falls back to the reference where it must."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import exact_attention, rel_err, rows_apart
from vecstore.config import StoreConfig
from vecstore.executor import EXECUTORS
from vecstore.executor.base import Steady
from vecstore.executor.numba_exec import NumbaExecutor
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.index.base import IndexView
from vecstore.index.quest import QuestIndex
from vecstore.index.wave import WaveIndex
from vecstore.kernels.cpu_decode import decode_rows
from vecstore.kernels.cpu_zones import split_zones

CFG = StoreConfig.from_dict({"index": {"segment_tokens": 512},
                             "attention": {"retrieval_budget": 0.05}})
H, D, G = 2, 32, 4


def _cfg(**sections: dict) -> StoreConfig:
    base = CFG.to_dict()
    return StoreConfig.from_dict({**base, **{k: {**base[k], **v} for k, v in sections.items()}})


def _batch(gen, dtype, lengths=(1500, 700), steady=(70, 33), index=None):
    index = index or WaveIndex(CFG)
    views = []
    for n in lengths:
        k = torch.randn(H, n, D, generator=gen).to(dtype)
        v = torch.randn(H, n, D, generator=gen).to(dtype)
        views.append(IndexView.from_segments(index.build(k, v, 4)))
    B, S = len(lengths), max(steady)
    zone = Steady(torch.randn(B, H, S, D, generator=gen).to(dtype),
                  torch.randn(B, H, S, D, generator=gen).to(dtype),
                  torch.tensor(steady[:B]))
    q = torch.randn(B, H * G, 1, D, generator=gen).to(dtype)
    return index, IndexView.stack(views), zone, q


def _assert_matches_reference(args, layer, softcap=None, tol=1e-5):
    ref = TorchExecutor().run(*args, D ** -0.5, layer, softcap)
    out, lse, stats = NumbaExecutor().run(*args, D ** -0.5, layer, softcap)
    assert out.dtype == args[3].dtype and out.shape == ref[0].shape
    assert rel_err(out, ref[0]) < tol and rel_err(lse, ref[1]) < 1e-5
    assert abs(stats.estimated_mass - ref[2].estimated_mass) < 1e-5
    assert (stats.tokens_total, stats.tokens_exact, stats.units_retrieved,
            stats.units_estimated) == (ref[2].tokens_total, ref[2].tokens_exact,
                                       ref[2].units_retrieved, ref[2].units_estimated)
    return out, lse, stats


def test_registered():
    assert EXECUTORS.get("numba") is NumbaExecutor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("radius_weight", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_matches_reference(dtype, radius_weight, softcap):
    cfg = _cfg(index={"radius_weight": radius_weight})
    gen = torch.Generator().manual_seed(1)
    args = _batch(gen, dtype, index=WaveIndex(cfg))
    # bf16 outputs are rounded to bf16 after the float32 merge, as the reference's are
    _assert_matches_reference(args, cfg.for_layer(0), softcap,
                              tol=1e-5 if dtype == torch.float32 else 1e-2)


def test_a_row_without_steady_tokens_and_small_budgets():
    gen = torch.Generator().manual_seed(2)
    args = _batch(gen, torch.float32, lengths=(900, 40), steady=(0, 5))
    _assert_matches_reference(args, CFG.for_layer(0))
    # one cluster retrieved per row, none estimated
    tiny = _cfg(attention={"retrieval_budget": 1e-9, "estimation_budget": 0.0})
    stats = _assert_matches_reference(args, tiny.for_layer(0))[2]
    assert stats.units_retrieved == 2 * H and stats.units_estimated == 0


def test_a_row_with_nothing_to_attend_to_is_empty():
    z = np.zeros((0, 4), np.float32)
    out, lse, mass, counts = decode_rows(
        np.ones((1, 2, 4), np.float32), z, z, np.zeros(1, np.int64), np.zeros((1, 1), np.int64),
        np.zeros((1, 0), np.int64), np.zeros((1, 0, 4), np.float32),
        np.zeros((1, 0), np.float32), np.zeros((1, 0, 4), np.float32), z, z,
        np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
        np.zeros(1, np.int64), scale=1.0, weight=0.5, softcap=None)
    assert np.isneginf(lse).all() and not out.any() and not mass.any()
    assert counts.tolist() == [[0, 0, 0]]


def test_full_budget_is_exact_attention():
    cfg = _cfg(attention={"retrieval_budget": 1.0})
    gen = torch.Generator().manual_seed(3)
    index, view, steady, q = _batch(gen, torch.float32, lengths=(900,), index=WaveIndex(cfg))
    out, lse, stats = NumbaExecutor().run(index, view, steady, q, D ** -0.5, cfg.for_layer(0))
    keys = torch.cat([steady.keys[0, :, :70], view.keys[0]], dim=1)
    values = torch.cat([steady.values[0, :, :70], view.values[0]], dim=1)
    ref_out, ref_lse = exact_attention(q[0], keys, values)
    assert rel_err(out[0], ref_out) < 1e-5 and rel_err(lse[0], ref_lse) < 1e-5
    assert stats.tokens_exact == stats.tokens_total == 970


@pytest.mark.parametrize("lengths", [(1500,), (1500, 1500)], ids=["layer", "stack"])
def test_rows_a_reserve_apart_are_read_in_place(lengths):
    # a tier's reserve: each head's rows contiguous, heads (and sequences) further apart;
    # the padding between them is NaN, so reading it would show
    gen = torch.Generator().manual_seed(4)
    index, view, steady, q = _batch(gen, torch.float32, lengths=lengths)
    apart = rows_apart(view, 37)
    B, heads, _, dim = view.keys.shape
    tail = torch.full((B, heads, 90, dim), float("nan"))
    tail[:, :, :70] = steady.keys
    wide = Steady(tail[:, :, :70], steady.values, steady.lengths)  # keys and values differ
    want = NumbaExecutor().run(index, view, steady, q, D ** -0.5, CFG.for_layer(0))
    got = NumbaExecutor().run(index, apart, wide, q, D ** -0.5, CFG.for_layer(0))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_equal_scores_rank_the_lower_cluster_id_first():
    # clusters whose centroids are all alike: every score ties, so the zones are the
    # lowest ids
    gen = torch.Generator().manual_seed(8)
    index = WaveIndex(_cfg(index={"tokens_per_cluster": 4}))
    view = IndexView.from_segments(index.build(torch.randn(1, 256, D, generator=gen),
                                               torch.randn(1, 256, D, generator=gen), 0))
    assert bool((view.sizes > 0).all())
    view = IndexView(keys=view.keys, values=view.values, offsets=view.offsets,
                     sizes=view.sizes, num_units=view.num_units,
                     meta={**view.meta, "centroids": torch.ones_like(view.meta["centroids"]),
                           "radii": torch.zeros_like(view.meta["radii"])})
    steady = Steady(torch.zeros(1, 1, 1, D), torch.zeros(1, 1, 1, D), torch.tensor([1]))
    prep = NumbaExecutor().prepare(view, CFG.for_layer(0), index)
    key = np.zeros(int(view.sizes.shape[-1]), np.float32)
    retrieved, estimated = split_zones(key, int(prep.retrieve[0]), int(prep.estimate[0]))
    r, e = len(retrieved), len(estimated)
    assert retrieved.tolist() == list(range(r)) and estimated.tolist() == list(range(r, r + e))
    out, _, stats = NumbaExecutor().run(index, view, steady, torch.ones(1, 1, 1, D), 1.0,
                                        CFG.for_layer(0))
    assert stats.units_retrieved == r and stats.units_estimated == e and out.isfinite().all()
    assert stats.tokens_exact == 1 + int(view.sizes[0, 0, :r].sum())  # the lowest ids' rows


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.5, -1.0, -2.0, float("inf")]), min_size=1,
                max_size=40), st.data())
def test_zones_are_a_stable_sorts_prefixes(keys, data):
    key = np.array(keys, np.float32)
    valid = int(np.isfinite(key).sum())
    r = data.draw(st.integers(0, valid))
    e = data.draw(st.integers(0, valid - r))
    order = np.argsort(key, kind="stable")
    retrieved, estimated = split_zones(key, r, e)
    assert retrieved.tolist() == sorted(order[:r].tolist())
    assert estimated.tolist() == sorted(order[r:r + e].tolist())


def test_falls_back_to_reference_where_it_must():
    gen = torch.Generator().manual_seed(5)
    ex = NumbaExecutor()
    index, view, steady, q = _batch(gen, torch.float32)
    half = _batch(gen, torch.float16)
    q2 = torch.randn(2, H * G, 3, D, generator=gen)  # prefill-like: L > 1
    quest = _batch(gen, torch.float32, index=QuestIndex(CFG))
    exact = StoreConfig.from_dict({**CFG.to_dict(), "layers": {0: {"exact": True}}})
    cases = [((index, view, steady, q2), CFG), (quest, CFG), (half, CFG),
             ((index, view, steady, q), exact)]
    for args, cfg in cases:
        assert not ex.can_run(args[0], args[1], args[3], cfg.for_layer(0))
        got = ex.run(*args, D ** -0.5, cfg.for_layer(0))
        ref = TorchExecutor().run(*args, D ** -0.5, cfg.for_layer(0))
        assert torch.equal(got[0], ref[0]) and got[2] == ref[2]
    assert not ex._prepared  # nothing was prepared for the fused path


def test_a_replaced_view_is_forgotten():
    gen = torch.Generator().manual_seed(6)
    index, view, steady, q = _batch(gen, torch.float32)
    ex = NumbaExecutor()
    ex.run(index, view, steady, q, D ** -0.5, CFG.for_layer(0))
    assert len(ex._prepared) == 1
    ex.release_view(view)
    assert not ex._prepared


def test_the_store_answers_through_it_on_the_cpu():
    from vecstore import Store

    gen = torch.Generator().manual_seed(7)
    keys, values = torch.randn(2, H, 3000, D, generator=gen)
    q = torch.randn(H * G, 1, D, generator=gen)
    answers = []
    for kind in ("numba", "torch"):
        with Store.open(config={**CFG.to_dict(), "executor": {"kind": kind}}) as store:
            seq = store.create("doc", num_layers=1, num_kv_heads=H, head_dim=D,
                               dtype=torch.float32)
            seq.append(0, keys, values)
            answers.append(seq.query(0, q))
    assert rel_err(answers[0].out, answers[1].out) < 1e-5
    fused, ref = answers[0].stats, answers[1].stats
    assert (fused.tokens_exact, fused.units_retrieved, fused.units_estimated) == (
        ref.tokens_exact, ref.units_retrieved, ref.units_estimated)
