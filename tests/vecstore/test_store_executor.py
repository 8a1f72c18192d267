"""The store builds its executor from its whole configuration."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreted, request_interpreter
from vecstore import Store, StoreConfig
from vecstore.errors import ConfigError
from vecstore.executor import base as executor_base
from vecstore.executor.base import build_executor
from vecstore.executor.numba_exec import NumbaExecutor
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.executor.wave_exec import WaveExecutor

request_interpreter()  # a prepared offloaded view fills its block cache with a Triton kernel


def test_wave_executor_takes_the_configured_block_cache():
    config = {"executor": {"kind": "wave"}, "cache": {"policy": "fifo", "capacity": 0.1}}
    with Store.open(config=config) as store:
        ex = store.executor
        assert isinstance(ex, WaveExecutor)
        assert (ex.cache_policy, ex.cache_capacity, ex.device) == ("fifo", 0.1, "cpu")


@interpreted
def test_wave_buffers_charge_the_stores_gpu_account():
    # the store builds its executor with its accounts; a buffer the executor builds for an
    # offloaded view (simulated on the CPU) charges the account of its device first
    config = {"executor": {"kind": "wave"}, "index": {"segment_tokens": 256},
              "attention": {"sink_tokens": 4, "window_tokens": 16, "update_tokens": 64}}
    with Store.open(config=config) as store:
        assert store.executor.accounts == store.placement.device_account
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        seq.append(0, torch.randn(2, 600, 8), torch.randn(2, 600, 8))
        account = store.placement.device_account(torch.device("cpu"))
        before = account.used_bytes
        ex = WaveExecutor(simulate_offload=True, accounts=store.placement.device_account)
        prep = ex.prepare(seq.view(0), store.config.for_layer(0), store.index_for(0))
        assert prep.buffer is not None
        assert account.used_bytes == before + prep.buffer.num_bytes


def test_executor_without_from_config_gets_the_device():
    with Store.open(config={"executor": {"kind": "torch"}}) as store:
        assert isinstance(store.executor, TorchExecutor) and store.executor.device == "cpu"


@pytest.mark.parametrize("kind", ["torch", "wave"])
def test_unknown_cache_policy_fails_at_open(kind):
    config = {"executor": {"kind": kind}, "cache": {"policy": "lruu"}}
    with pytest.raises(ConfigError, match=r"cache policy.*'lruu'.*lru"):
        Store.open(config=config)


@pytest.mark.parametrize(("device", "triton", "expected"), [
    ("cpu", True, NumbaExecutor), ("cuda", True, WaveExecutor), ("cuda:1", True, WaveExecutor),
    ("cuda", False, TorchExecutor), ("cpu", False, NumbaExecutor)])
def test_auto_executor_follows_device_and_triton(monkeypatch, device, triton, expected):
    monkeypatch.setattr(executor_base, "has_triton", lambda: triton)
    config = StoreConfig.from_dict({"executor": {"device": device}})
    assert config.executor.kind == "auto"  # the default
    ex = build_executor(config)
    assert type(ex) is expected and ex.device == device


@pytest.mark.parametrize("kind", ["torch", "wave", "numba"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_executor_kind_is_kept(monkeypatch, kind, device):
    monkeypatch.setattr(executor_base, "has_triton", lambda: device == "cuda")
    ex = build_executor(StoreConfig.from_dict({"executor": {"kind": kind, "device": device}}))
    assert type(ex) is {"torch": TorchExecutor, "wave": WaveExecutor,
                        "numba": NumbaExecutor}[kind]
