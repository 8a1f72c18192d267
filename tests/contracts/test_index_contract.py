"""The :class:`~vecstore.index.Index` contract, for every index in ``INDEXES``.

``build`` lays tokens out unit by unit without losing or changing one, each head on its own;
``rank`` scores every unit of a padded batch, ``-inf`` exactly for the empty ones; and the
store's probe (``Sequence.search``) returns valid, distinct unit ids, best first.
"""

from __future__ import annotations

import pytest
import torch

from vecstore import Store
from vecstore.config import StoreConfig
from vecstore.index import INDEXES, Index, IndexView, Segment

NAMES = INDEXES.names()
H, D = 2, 8
CFG = StoreConfig.from_dict({"index": {"tokens_per_cluster": 4, "segment_tokens": 32,
                                       "page_tokens": 4}})


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)


def _rows(segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cat([s.keys for s in segments], dim=1),
            torch.cat([s.values for s in segments], dim=1))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 5, 50])
def test_build_keeps_every_token_with_its_value(name: str, n: int) -> None:
    index = INDEXES.get(name)(CFG)
    assert isinstance(index, Index)
    keys, values = _kv(n, seed=n)
    segments = index.build(keys, values, 7)
    assert segments[0].start == 7 and segments[-1].end == 7 + n
    assert all(a.end == b.start for a, b in zip(segments, segments[1:], strict=False))
    for s in segments:
        U = s.num_units
        assert s.keys.shape == s.values.shape == (H, s.num_tokens, D)
        assert s.offsets.shape == (H, U + 1) and s.offsets.dtype == torch.int64
        assert (s.offsets[:, 0] == 0).all() and (s.offsets[:, -1] == s.num_tokens).all()
        assert (s.offsets.diff(dim=-1) >= 0).all()
        assert all(t.shape[:2] == (H, U) for t in s.meta.values())
    got_k, got_v = _rows(segments)
    for h in range(H):  # each head's rows are a permutation of its (key, value) pairs
        got = torch.cat([got_k[h], got_v[h]], dim=-1)
        want = torch.cat([keys[h], values[h]], dim=-1)
        order = lambda x: x[torch.argsort(x[:, 0])]  # noqa: E731 - keys are distinct
        assert torch.equal(order(got), order(want))


@pytest.mark.parametrize("name", NAMES)
def test_heads_are_built_on_their_own(name: str) -> None:
    # the store builds a batch's segments in one call over the rows' heads stacked
    # (vecstore.engine.batch_build): each row's share must be its own build
    index = INDEXES.get(name)(CFG)
    rows = [_kv(45, seed=s) for s in (3, 4)]
    stacked = index.build(torch.cat([k for k, _ in rows]), torch.cat([v for _, v in rows]), 0)
    for r, (keys, values) in enumerate(rows):
        own = index.build(keys, values, 0)
        heads = slice(r * H, (r + 1) * H)
        assert [(s.start, s.end) for s in own] == [(s.start, s.end) for s in stacked]
        for a, b in zip(own, stacked, strict=True):
            assert torch.equal(a.keys, b.keys[heads])
            assert torch.equal(a.values, b.values[heads])
            assert torch.equal(a.offsets, b.offsets[heads])
            assert sorted(a.meta) == sorted(b.meta)
            for key in a.meta:
                torch.testing.assert_close(a.meta[key], b.meta[key][heads])


@pytest.mark.parametrize("name", [n for n in NAMES if INDEXES.get(n)(CFG).can_estimate])
def test_an_estimating_index_keeps_each_units_centroid_and_value_sum(name: str) -> None:
    keys, values = _kv(40, seed=1)
    for s in INDEXES.get(name)(CFG).build(keys, values, 0):
        for h in range(H):
            for u in range(s.num_units):
                a, b = int(s.offsets[h, u]), int(s.offsets[h, u + 1])
                assert torch.allclose(s.meta["value_sums"][h, u], s.values[h, a:b].sum(0),
                                      atol=1e-5)
                assert s.meta["centroids"][h, u].shape == (D,)


@pytest.mark.parametrize("name", NAMES)
def test_rank_scores_every_unit_of_a_padded_batch(name: str) -> None:
    index = INDEXES.get(name)(CFG)
    views = [IndexView.from_segments(index.build(*_kv(n, seed=n), 0)) for n in (40, 9)]
    view = IndexView.stack(views)
    q = torch.randn(2, H, 3, 2, D, generator=torch.Generator().manual_seed(2))
    score = index.rank(view, q, D ** -0.5)
    assert score.shape == view.sizes.shape and score.dtype == torch.float32
    assert torch.equal(torch.isneginf(score), view.sizes == 0)
    assert not score.isnan().any()


@pytest.mark.parametrize("name", NAMES)
def test_the_probe_returns_valid_distinct_units_best_first(name: str) -> None:
    keys, values = _kv(60, seed=3)
    config = {"index": {"kind": name, "tokens_per_cluster": 4, "segment_tokens": 32,
                        "page_tokens": 4},
              "attention": {"sink_tokens": 2, "window_tokens": 2, "update_tokens": 4}}
    with Store.open(config=config) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=H, head_dim=D, dtype="float32")
        seq.append(0, keys, values)
        sizes = seq.view(0).sizes[0]  # [H, C]
        hit = seq.search(0, torch.randn(2 * H, 1, D), 60)
    for h in range(H):
        units = (sizes[h] > 0).sum().item()
        ids = hit.ids[h, :units]
        assert sorted(ids.tolist()) == (sizes[h] > 0).nonzero().flatten().tolist()
        assert (hit.ids[h, units:] == -1).all() and torch.isneginf(hit.scores[h, units:]).all()
        assert (hit.scores[h, :units].diff() <= 0).all()
