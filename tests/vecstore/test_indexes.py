"""Each index returns what its definition says on cases checkable by hand; the contract
every index keeps is in ``tests/contracts/test_index_contract.py``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecstore import Store
from vecstore.config import StoreConfig
from vecstore.errors import ConfigError
from vecstore.index import INDEXES, IndexView
from vecstore.index.wave import bound_logits

PAGE4 = {"index": {"page_tokens": 4, "tokens_per_cluster": 4},
         "attention": {"sink_tokens": 0, "window_tokens": 0, "update_tokens": 1}}


def _store(kind: str, **attention: float) -> Store:
    cfg = {"index": {**PAGE4["index"], "kind": kind},
           "attention": {**PAGE4["attention"], **attention}}
    return Store.open(config=cfg)


def test_quest_picks_the_page_with_the_largest_upper_bound():
    keys = torch.zeros(1, 12, 2)
    keys[0, 0:4] = torch.tensor([1.0, 0.0])   # page 0: q·k = 1
    keys[0, 4:8] = torch.tensor([0.0, 5.0])   # page 1: q·k = 5
    keys[0, 8:12] = torch.tensor([2.0, 0.0])  # page 2: q·k = 2
    with _store("quest", retrieval_budget=0.34) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
        seq.append(0, keys, torch.randn(1, 12, 2))
        hit = seq.search(0, torch.tensor([[[1.0, 1.0]]]), 3)
    assert hit.ids.tolist() == [[1, 2, 0]]
    assert hit.scores.tolist() == [[5.0, 2.0, 1.0]]


def test_quest_bound_uses_min_for_negative_query_components():
    keys = torch.tensor([[[1.0], [-3.0], [0.5], [0.5]]])  # one page: min -3, max 1
    with _store("quest") as store:
        seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
        seq.append(0, keys, keys)
        hit = seq.search(0, torch.tensor([[[-2.0]]]), 1)
    assert hit.scores.tolist() == [[6.0]]  # max(-2*-3, -2*1)


def test_sink_window_retrieves_the_most_recent_pages():
    with _store("sink_window", retrieval_budget=0.5) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
        seq.append(0, torch.randn(1, 16, 2), torch.randn(1, 16, 2))
        hit = seq.search(0, torch.randn(1, 1, 2), 2)
        res = seq.query(0, torch.randn(1, 1, 2))
    assert hit.ids.tolist() == [[3, 2]]
    assert res.stats.tokens_exact == 8


def test_topk_oracle_returns_the_highest_scoring_tokens():
    keys = torch.tensor([[[0.1], [3.0], [-1.0], [2.0], [0.0]]])
    with _store("topk_oracle") as store:
        seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
        seq.append(0, keys, keys)
        hit = seq.search(0, torch.tensor([[[1.0]]]), 3)
    assert hit.ids.tolist() == [[1, 3, 0]]


def test_flat_is_exact_at_any_budget():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 64, 4, generator=gen), torch.randn(1, 64, 4, generator=gen)
    with _store("flat", retrieval_budget=0.01) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
        seq.append(0, keys, values)
        res = seq.query(0, torch.randn(1, 1, 4, generator=gen))
    assert res.stats.tokens_exact == 64


def test_wave_groups_well_separated_keys_into_their_clusters():
    centers = torch.tensor([[10.0, 0.0], [0.0, 10.0], [-10.0, 0.0], [0.0, -10.0]])
    keys = centers.repeat_interleave(4, 0)[None] + 0.01 * torch.randn(1, 16, 2)
    with _store("wave") as store:
        seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
        seq.append(0, keys, keys)
        view = seq.view(0)
        hit = seq.search(0, torch.tensor([[[0.0, 1.0]]]), 1)
    assert view is not None
    assert sorted(view.sizes[0, 0].tolist()) == [4, 4, 4, 4]
    best = int(hit.ids[0, 0])
    assert torch.allclose(view.meta["centroids"][0, 0, best], torch.tensor([0.0, 10.0]),
                          atol=0.05)
    a, b = int(view.offsets[0, 0, best]), int(view.offsets[0, 0, best + 1])
    assert torch.allclose(view.meta["value_sums"][0, 0, best], view.values[0, 0, a:b].sum(0))


def test_segments_split_long_prefill_evenly():
    cfg = {"index": {"segment_tokens": 100, "tokens_per_cluster": 10},
           "attention": {"sink_tokens": 4, "window_tokens": 6, "update_tokens": 10}}
    with Store.open(config=cfg) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32")
        seq.append(0, torch.randn(2, 350, 4), torch.randn(2, 350, 4))
        segs = seq.layers[0].segments
    assert [s.num_tokens for s in segs] == [85, 85, 85, 85]
    assert segs[0].start == 4 and segs[-1].end == 344
    assert all(s.num_units == 9 for s in segs)


def test_index_view_stack_pads_with_empty_units():
    idx = INDEXES.get("wave")(StoreConfig.from_dict(PAGE4))
    a = IndexView.from_segments(idx.build(torch.randn(1, 8, 2), torch.randn(1, 8, 2), 0))
    b = IndexView.from_segments(idx.build(torch.randn(1, 20, 2), torch.randn(1, 20, 2), 0))
    both = IndexView.stack([a, b])
    assert both.sizes.shape == (2, 1, 5)
    assert both.sizes[0, 0, 2:].tolist() == [0, 0, 0]
    assert both.offsets[0, 0, -1] == 8 and both.num_units.tolist() == [2, 5]


@settings(deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(8, 64), st.sampled_from([2, 4, 8]))
def test_wave_radius_bound_is_at_least_every_member_score(seed, n, tpc):
    gen = torch.Generator().manual_seed(seed)
    keys = 3 * torch.randn(2, n, 4, generator=gen)
    idx = INDEXES.get("wave")(StoreConfig.from_dict({"index": {"tokens_per_cluster": tpc}}))
    view = IndexView.from_segments(idx.build(keys, torch.randn(2, n, 4, generator=gen), 0))
    q = torch.randn(1, 2, 3, 1, 4, generator=gen)
    bound = bound_logits(q, view.meta["centroids"], view.meta["radii"], 1.0, 1.0)
    exact = torch.einsum("bhgld,bhnd->bhgln", q, view.keys.float())
    for h in range(2):
        for c in range(view.sizes.shape[-1]):
            a, b = view.offsets[0, h, c], view.offsets[0, h, c + 1]
            if a == b:
                continue
            members = view.keys[0, h, a:b].float()
            spread = (members - view.meta["centroids"][0, h, c]).norm(dim=-1).max()
            assert torch.allclose(view.meta["radii"][0, h, c], spread, atol=1e-5)
            best = exact[0, h, :, :, a:b].amax(-1)
            assert (bound[0, h, :, :, c] >= best - 1e-4).all()


def test_wave_radius_weight_finds_the_cluster_hiding_an_outlier():
    # cluster A: 7 keys at (2, 0, 0) and one at (2, 0, 1.2); cluster B: 8 keys at (-2, 0, 0.5)
    keys = torch.tensor([[2.0, 0.0, 0.0]] * 7 + [[2.0, 0.0, 1.2]] + [[-2.0, 0.0, 0.5]] * 8)
    keys = keys[None] + 0.01 * torch.randn(1, 16, 3, generator=torch.Generator().manual_seed(0))
    q = torch.tensor([[[0.0, 0.0, 4.0]]])
    found = {}
    for weight in (0.0, 1.0):
        cfg = {"index": {"kind": "wave", "tokens_per_cluster": 8, "radius_weight": weight},
               "attention": {**PAGE4["attention"], "retrieval_budget": 0.5}}
        with Store.open(config=cfg) as store:
            seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=3, dtype="float32")
            seq.append(0, keys, keys)
            view = seq.view(0)
            assert view is not None and sorted(view.sizes[0, 0].tolist()) == [8, 8]
            best = int(seq.search(0, q, 1).ids[0, 0])
            a, b = int(view.offsets[0, 0, best]), int(view.offsets[0, 0, best + 1])
            found[weight] = view.keys[0, 0, a:b, 2].amax().item()
    assert found[0.0] < 0.6  # the centroid ranking picks cluster B (z = 0.5 everywhere)
    assert found[1.0] > 1.1  # the bound picks cluster A, which holds z = 1.2


def test_wave_radius_weight_must_be_finite_and_non_negative():
    with pytest.raises(ConfigError, match="index.radius_weight"):
        StoreConfig.from_dict({"index": {"radius_weight": -1.0}})
    with pytest.raises(ConfigError, match="index.radius_weight"):
        StoreConfig.from_dict({"index": {"radius_weight": float("nan")}})
