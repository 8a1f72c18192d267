"""Decoder layers compiled around their attention (``WaveCache(compile_layers=True)``), on
the CPU with the fused step replaced by exact attention in torch (Inductor compiles the
layers for the CPU; the CUDA-graph path runs under ``-m gpu``): the same tokens as
DynamicCache across segment flushes with a left-padded batch, one set of compiled graphs
whatever the number of layers, attention never traced, forwards restored."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache

from integrations.hf import WaveCache
from integrations.hf.layer_compile import CompiledLayers, decoder_layers
from tests.integrations.exact_decode import exact_decode
from tests.integrations.hf_models import generate, left_padded, tiny_model
from vecstore.errors import IncompatibleError, InvalidValueError
from vecstore.executor.wave_exec import WaveExecutor

WAVE = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
        "attention": {"sink_tokens": 2, "window_tokens": 4, "update_tokens": 8},
        "executor": {"kind": "wave", "device": "cpu"}}


@pytest.fixture(autouse=True)
def _exact_step(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused path takes CPU tensors
    monkeypatch.setattr(WaveExecutor, "decode", exact_decode)


def _generate(model, ids, mask, new, **cache_kw):
    with WaveCache(WAVE, model, cuda_graphs=True, **cache_kw) as cache:
        cache.store._executor.backend = "triton"
        out = generate(model, ids, cache, attention_mask=mask, max_new_tokens=new,
                       do_sample=False, eos_token_id=None)
        return out, cache.graph.static_steps


@pytest.mark.parametrize("layers", [2, 4])
def test_compiled_steps_equal_dynamic_cache_with_one_set_of_graphs(layers):
    model = tiny_model("llama", 4, 2, seed=1, layers=layers)
    ids, mask = left_padded([30, 45, 21], seed=1)
    new = 30  # update_tokens 8: the tails index segments three times, each recaptured
    ref = generate(model, ids, DynamicCache(), attention_mask=mask, max_new_tokens=new,
                   do_sample=False, eos_token_id=None)
    torch._dynamo.reset()
    counters.clear()
    out, static = _generate(model, ids, mask, new, compile_layers=True)
    assert torch.equal(out, ref)
    assert static == new - 1 - 4  # as without compiling: the fixed-shape steps ran compiled
    # the norm before the attention and the rest of the layer after it, two graphs for
    # every layer (a graph per layer would recompile up to dynamo's limit, then run eager),
    # and the final norm and the rotary embedding
    assert counters["stats"]["unique_graphs"] == 4


def test_the_attention_module_runs_uncompiled_and_forwards_come_back():
    model = tiny_model("llama", 4, 2, seed=2, layers=2)
    ids, mask = left_padded([20, 26], seed=2)
    traced: list[bool] = []
    for _, attn in decoder_layers(model):
        inner = attn.forward

        def spy(*args, _inner=inner, **kwargs):
            traced.append(torch.compiler.is_compiling())
            return _inner(*args, **kwargs)

        attn.forward = spy
    _generate(model, ids, mask, 6, compile_layers=True)
    assert traced and not any(traced)  # every call eager, none traced into a graph
    for layer, attn in decoder_layers(model):
        assert "forward" not in vars(layer) and vars(attn)["forward"].__name__ == "spy"


def test_forwards_come_back_when_the_step_raises():
    model = tiny_model("llama", 4, 2, seed=3, layers=2)
    compiled = CompiledLayers(model)
    with pytest.raises(RuntimeError, match="boom"), compiled.active():
        assert all("forward" in vars(layer) for layer, _ in decoder_layers(model))
        raise RuntimeError("boom")
    assert all("forward" not in vars(m) for pair in decoder_layers(model) for m in pair)
    assert "forward" not in vars(model.model.norm) and "forward" not in vars(
        model.model.rotary_emb)


def test_compile_layers_needs_fixed_shape_steps():
    model = tiny_model("llama", 4, 2, seed=4, layers=2)
    with pytest.raises(InvalidValueError, match="compile_layers: .*cuda_graphs=True"):
        WaveCache(WAVE, model, cuda_graphs=False, compile_layers=True)
    with pytest.raises(InvalidValueError, match="compile_layers"):  # CPU: no graphs by default
        WaveCache(WAVE, model, compile_layers=True)


def test_an_attention_module_outside_a_decoder_layer_is_refused():
    attn = tiny_model("llama", 4, 2, seed=5, layers=1).model.layers[0].self_attn
    with pytest.raises(IncompatibleError, match="LlamaAttention is not held by a decoder"):
        CompiledLayers(attn)
