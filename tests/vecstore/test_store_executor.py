"""The store builds its executor from its whole configuration."""

from __future__ import annotations

import pytest

from vecstore import Store
from vecstore.errors import ConfigError
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.executor.wave_exec import WaveExecutor


def test_wave_executor_takes_the_configured_block_cache():
    config = {"executor": {"kind": "wave"}, "cache": {"policy": "fifo", "capacity": 0.1}}
    with Store.open(config=config) as store:
        ex = store._executor
        assert isinstance(ex, WaveExecutor)
        assert (ex.cache_policy, ex.cache_capacity, ex.device) == ("fifo", 0.1, "cpu")


def test_executor_without_from_config_gets_the_device():
    with Store.open(config={"executor": {"kind": "torch"}}) as store:
        assert isinstance(store._executor, TorchExecutor) and store._executor.device == "cpu"


@pytest.mark.parametrize("kind", ["torch", "wave"])
def test_unknown_cache_policy_fails_at_open(kind):
    config = {"executor": {"kind": kind}, "cache": {"policy": "lruu"}}
    with pytest.raises(ConfigError, match=r"cache policy.*'lruu'.*lru"):
        Store.open(config=config)
