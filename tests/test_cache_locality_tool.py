"""benchmarks/cache_locality.py: the LRU hit rate of recorded retrieval zones, and the
recording of every decode step's zones through a WaveCache."""

from __future__ import annotations

import torch

from benchmarks import cache_locality
from tests.integrations.hf_models import SMALL, tiny_model


def _zones(*ids: list[int], size: int = 4) -> list[cache_locality.Zone]:
    # one sequence, one KV head, 40 clusters (two slots at 5%), clusters of `size` rows
    return [cache_locality.Zone(torch.tensor([[row]]), torch.full((1, 1, len(row)), size), 40)
            for row in ids]


def test_hit_rate_follows_least_recently_used(monkeypatch):
    monkeypatch.setattr(cache_locality, "WARMUP_STEPS", 0)
    # two slots: 0 1 miss; 2 misses, evicts 0; 0 misses, evicts 1; 2 hits; 0 hits; 1 misses;
    # padding is never looked up
    steps = _zones([0, 1], [2, -1], [0, -1], [2, -1], [0, -1], [1, -1])
    assert cache_locality.hit_rate(steps, 0.05) == 2 / 7
    # warm-up steps fill the cache but are not counted
    monkeypatch.setattr(cache_locality, "WARMUP_STEPS", 3)
    assert cache_locality.hit_rate(steps, 0.05) == 2 / 3
    # a larger cache keeps everything seen
    assert cache_locality.hit_rate(steps, 1.0) == 1.0


def test_clusters_larger_than_a_slot_are_looked_up_but_never_cached(monkeypatch):
    monkeypatch.setattr(cache_locality, "WARMUP_STEPS", 1)
    big = _zones([0, 1], [0, 1], [0, 1], size=40)
    assert cache_locality.hit_rate(big, 0.05) == 1.0
    assert cache_locality.hit_rate(big, 0.05, slot_tokens=32) == 0.0
    mixed = [cache_locality.Zone(torch.tensor([[[0, 1]]]), torch.tensor([[[4, 40]]]), 40)] * 3
    assert cache_locality.hit_rate(mixed, 0.05, slot_tokens=32) == 0.5


def test_record_sees_every_decode_step_of_every_layer():
    model = tiny_model(layers=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 200),
                        generator=torch.Generator().manual_seed(0))
    config = {**SMALL, "executor": {"kind": "torch"}}
    zones, capacity = cache_locality.record(model, ids, 5, config)
    assert len(zones) == 2 and capacity == 0.05
    for layer in zones:
        assert len(layer) == 5  # the steps after the prefill's token
        for zone in layer:
            assert zone.ids.shape[:2] == (1, 2) and zone.clusters > 0
            taken = zone.ids >= 0
            assert taken.any() and (zone.ids < zone.clusters).all()
            assert (zone.sizes[taken] > 0).all() and (zone.sizes[~taken] == 0).all()


def test_run_replays_the_zones_through_each_capacity():
    model = tiny_model(layers=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 300),
                        generator=torch.Generator().manual_seed(0))
    caps = [0.05, 0.2, 1.0]
    rows = cache_locality.run("tiny", model, ids, 12, caps)
    assert [r["capacity"] for r in rows] == caps
    # LRU keeps what a smaller LRU keeps (inclusion): the hit rate cannot fall as it grows
    rates = [r["hit_rate"] for r in rows]
    assert rates == sorted(rates) and rates[-1] > rates[0]
    assert len({(r["steps"], r["clusters_per_head"], r["retrieved_rows_mean"]) for r in rows}) == 1
