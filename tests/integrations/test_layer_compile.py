"""Decoder layers compiled around the store's attention (``WaveCache(compile_layers=True)``),
on the CPU with the fused step replaced by exact attention in torch (Inductor compiles the
layers for the CPU; the CUDA-graph path runs under ``-m gpu``): the same tokens as
DynamicCache across segment flushes with a left-padded batch, graphs shared by the layers
past dynamo's default limit, the cache update and attention never traced, forwards
restored."""

from __future__ import annotations

import sys

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache

from integrations.hf import WaveCache
from integrations.hf.cache_layer import WaveCacheLayer
from integrations.hf.layer_compile import CompiledLayers, decoder_layers
from tests.integrations.exact_decode import CPU_WAVE, exact_wave_step  # noqa: F401
from tests.integrations.hf_models import arch_model, generate, left_padded, tiny_model
from vecstore.errors import IncompatibleError, InvalidValueError

pytestmark = pytest.mark.usefixtures("exact_wave_step")


def _generate(model, ids, mask, new, **cache_kw):
    with WaveCache(CPU_WAVE, model, cuda_graphs=True, **cache_kw) as cache:
        cache.store.executor.backend = "triton"
        out = generate(model, ids, cache, attention_mask=mask, max_new_tokens=new,
                       do_sample=False, eos_token_id=None)
        return out, cache.graph.static_steps


@pytest.mark.parametrize("layers", [2, 10])
def test_compiled_steps_equal_dynamic_cache_with_shared_graphs(layers):
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
    # a graph per layer up to its cache update (its layer_idx is a constant), all compiled
    # past dynamo's default limit of 8; the rest of the layers, the final norm and the
    # rotary embedding shared by all layers
    assert counters["stats"]["unique_graphs"] == layers + 5


def test_the_cache_update_and_the_attention_run_uncompiled_and_forwards_come_back(
        monkeypatch):
    model = tiny_model("llama", 4, 2, seed=2, layers=2)
    ids, mask = left_padded([20, 26], seed=2)
    traced: dict[str, list[bool]] = {"update": [], "attention": []}
    install_module = sys.modules["integrations.hf.install"]
    for owner, name, key in ((WaveCacheLayer, "update", "update"),
                             (install_module, "vecstore_attention", "attention")):
        inner = getattr(owner, name)

        def spy(*args, _inner=inner, _key=key, **kwargs):
            traced[_key].append(torch.compiler.is_compiling())
            return _inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    _generate(model, ids, mask, 6, compile_layers=True)
    # every call eager: the store's side of the step is never traced into a graph
    assert all(traced.values()) and not any(any(v) for v in traced.values())
    assert all("forward" not in vars(m) for pair in decoder_layers(model) for m in pair)


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
        WaveCache(CPU_WAVE, model, cuda_graphs=False, compile_layers=True)
    with pytest.raises(InvalidValueError, match="compile_layers"):  # CPU: no graphs by default
        WaveCache(CPU_WAVE, model, compile_layers=True)


def test_an_attention_module_outside_a_decoder_layer_is_refused():
    attn = tiny_model("llama", 4, 2, seed=5, layers=1).model.layers[0].self_attn
    with pytest.raises(IncompatibleError, match="LlamaAttention is not held by a decoder"):
        CompiledLayers(attn)


def test_batch_sizes_and_cache_types_compile_every_layer(caplog):
    # ten layers, two batch sizes of WaveCache and a FullCache in one process: thirty
    # variants of the frame before the cache update, past dynamo's limit but for the raise
    from benchmarks.full_attention import FullCache
    from benchmarks.full_graph import DecodeGraph

    model = tiny_model("llama", 4, 2, seed=6, layers=10)
    torch._dynamo.reset()
    for lengths in ([30, 45, 21], [40, 33]):
        ids, mask = left_padded(lengths, seed=6)
        _generate(model, ids, mask, 4, compile_layers=True)
    ids, mask = left_padded([30, 45, 21], seed=6)
    with FullCache(model, 3, 64) as cache, torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, cache=cache)
        step = DecodeGraph(model, cache, compile_layers=True)
        step(ids[:, -1:])
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]


@pytest.mark.parametrize(("arch", "settings"), [
    ("qwen2", {}),  # biased projections
    ("gemma2", {"layer_types": ["full_attention"] * 2}),  # soft-capped, scaled embeddings
])
def test_other_architectures_compile_to_the_same_tokens(arch, settings):
    model = arch_model(arch, **settings)
    ids, mask = left_padded([30, 45], seed=7)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = generate(model, ids, DynamicCache(config=model.config), **kwargs)
    with WaveCache(CPU_WAVE, model, cuda_graphs=True, compile_layers=True) as cache:
        cache.store.executor.backend = "triton"
        out = generate(model, ids, cache, **kwargs)
        assert cache.graph.static_steps > 0
    assert torch.equal(out, ref)
