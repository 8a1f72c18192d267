"""Config: defaults, validation naming the key, TOML and dict round trips, overrides."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vecstore.config import StoreConfig, load_config
from vecstore.errors import ConfigError


def test_defaults_follow_the_design():
    c = StoreConfig()
    assert (c.attention.sink_tokens, c.attention.window_tokens) == (4, 64)
    assert (c.index.tokens_per_cluster, c.index.segment_tokens, c.index.kmeans_iters) == (16,
                                                                                          8192, 10)
    assert (c.attention.retrieval_budget, c.attention.estimation_budget) == (0.018, 0.232)
    assert (c.attention.update_tokens, c.cache.policy, c.cache.capacity) == (1024, "lru", 0.05)
    assert c.attention.prefill_group_gb == 4.0
    assert c.attention.prefill_mirror_gb is None  # the device's bound (off on a CPU)


@pytest.mark.parametrize("data,match", [
    ({"attention": {"retrival_budget": 0.1}},
     r"unknown config key 'attention\.retrival_budget'; "
     r"did you mean 'attention\.retrieval_budget'\?"),
    ({"indx": {}}, "unknown config key 'indx'.*did you mean 'index'"),
    ({"attention": {"retrieval_budget": 0.0}}, r"attention\.retrieval_budget: must be in \(0, 1\]"),
    ({"attention": {"estimation_budget": 1.5}}, r"attention\.estimation_budget"),
    ({"attention": {"sink_tokens": -1}}, r"attention\.sink_tokens"),
    ({"attention": {"window_tokens": "64"}}, r"attention\.window_tokens: expected an integer"),
    ({"attention": {"prefill_group_gb": -1}}, r"attention\.prefill_group_gb: must be >= 0"),
    ({"attention": {"prefill_group_gb": float("nan")}}, r"attention\.prefill_group_gb"),
    ({"attention": {"prefill_mirror_gb": -0.5}}, r"attention\.prefill_mirror_gb: must be >= 0"),
    ({"attention": {"prefill_mirror_gb": float("nan")}}, r"attention\.prefill_mirror_gb"),
    ({"index": {"tokens_per_cluster": 0}}, r"index\.tokens_per_cluster"),
    ({"index": {"segment_tokens": 8, "tokens_per_cluster": 16}}, r"index\.segment_tokens"),
    ({"cache": {"capacity": 2.0}}, r"cache\.capacity"),
    ({"executor": {"device": "tpu"}}, r"executor\.device"),
    ({"layers": {"x": {}}}, r"layers\.x: layer keys must be integers"),
    ({"layers": {"2": {"retrieval_budget": 3}}}, r"layers\.2\.retrieval_budget"),
    ({"layers": {"2": {"exactt": True}}}, r"'layers\.2\.exactt'; did you mean 'layers\.2\.exact'"),
    ({"layers": {"1": {"exact": 1}}}, r"layers\.1\.exact: expected true/false"),
    ({"attention": 3}, "attention: expected a table"),
])
def test_bad_values_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        StoreConfig.from_dict(data)


def test_toml_file_and_per_layer_overrides(tmp_path):
    path = tmp_path / "vecstore.toml"
    path.write_text('[attention]\nretrieval_budget = 0.05\n\n[layers.0]\nexact = true\n\n'
                    '[layers.3]\nestimation_budget = 1.0\n')
    cfg = load_config(path)
    assert cfg.for_layer(0).exact and not cfg.for_layer(1).exact
    assert cfg.for_layer(3).estimation_budget == 1.0 and cfg.for_layer(3).retrieval_budget == 0.05
    with pytest.raises(ConfigError, match="missing.toml.*No such file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[attention\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)


@given(rb=st.floats(0.001, 1.0), eb=st.floats(0.0, 1.0), tpc=st.integers(1, 64),
       policy=st.sampled_from(["lru", "fifo"]), layers=st.dictionaries(
           st.integers(0, 40), st.booleans(), max_size=4))
def test_to_dict_round_trips(rb, eb, tpc, policy, layers):
    cfg = StoreConfig.from_dict({
        "attention": {"retrieval_budget": rb, "estimation_budget": eb},
        "index": {"tokens_per_cluster": tpc}, "cache": {"policy": policy},
        "layers": {str(k): {"exact": v} for k, v in layers.items()},
    })
    assert StoreConfig.from_dict(cfg.to_dict()) == cfg


def test_every_field_is_documented():
    """Each config dataclass documents every field in its Attributes section."""
    from vecstore import config as mod
    for cls in (mod.IndexConfig, mod.AttentionConfig, mod.ClusterConfig, mod.CacheConfig,
                mod.ExecutorConfig, mod.KVStoreConfig, mod.LayerOverride, mod.StoreConfig):
        doc = cls.__doc__ or ""
        for f in dataclasses.fields(cls):
            assert f"{f.name} :" in doc or f"{f.name}," in doc, f"{cls.__name__}.{f.name}"


def test_conflicts_name_both_values():
    stored = StoreConfig()
    given_ = StoreConfig.from_dict({"index": {"tokens_per_cluster": 32},
                                    "attention": {"retrieval_budget": 0.1}})
    assert given_.conflicts_with(stored) == ["index.tokens_per_cluster (stored 16, given 32)"]
