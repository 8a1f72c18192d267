"""install() and WaveCache leave transformers and the model exactly as they found them."""

from __future__ import annotations

import gc

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from integrations.hf import ATTENTION_NAME, WaveCache, install, model_fingerprint
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import left_padded, tiny_model


def _registered() -> tuple[bool, bool]:
    return (ATTENTION_NAME in AttentionInterface._global_mapping,
            ATTENTION_NAME in AttentionMaskInterface._global_mapping)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, **{cache_kwarg(model): DynamicCache()}).logits


def test_install_registers_and_restores_everything():
    model = tiny_model()
    assert _registered() == (False, False)
    with install(model) as binding:
        assert _registered() == (True, True)
        assert model.config._attn_implementation == ATTENTION_NAME
        assert binding is not None
        with install(model), install():  # nested installs share the registration
            assert _registered() == (True, True)
        assert model.config._attn_implementation == ATTENTION_NAME
    assert _registered() == (False, False)
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_vecstore_binding") for m in model.modules())


def test_overlapping_caches_close_in_any_order():
    model = tiny_model()
    first, second = WaveCache(None, model), WaveCache(None, model)
    first.close()
    assert model.config._attn_implementation == ATTENTION_NAME  # the second is still open
    second.close()
    second.close()  # closing twice is harmless
    assert model.config._attn_implementation == "sdpa" and _registered() == (False, False)


def test_garbage_collected_cache_detaches():
    model = tiny_model()
    cache = WaveCache(None, model)
    assert model.config._attn_implementation == ATTENTION_NAME
    del cache
    gc.collect()
    assert model.config._attn_implementation == "sdpa" and _registered() == (False, False)


def test_other_caches_run_plain_sdpa_while_installed():
    model = tiny_model()
    ids, mask = left_padded([30, 45])
    ref = _logits(model, ids, mask)
    with install(model):
        assert torch.equal(_logits(model, ids, mask), ref)
    with WaveCache(None, model):
        assert torch.equal(_logits(model, ids, mask), ref)


def test_fingerprint_tells_checkpoints_apart():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    assert model_fingerprint(a) == model_fingerprint(tiny_model(seed=0))
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a).startswith("llama-")
