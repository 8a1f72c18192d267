"""fuse_qkv: each attention module's query, key and value projections run as one GEMM and give
the separate projections' outputs, on every tested architecture, through a WaveCache with
the layers compiled, and with a state dict loaded afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from integrations.hf import WaveCache
from integrations.hf.capabilities import attention_modules
from integrations.hf.fused_qkv import FusedPart, FusedQuery, fuse_qkv
from tests.integrations.exact_decode import CPU_WAVE, exact_wave_step  # noqa: F401
from tests.integrations.hf_models import ARCHITECTURES, arch_model, generate, left_padded


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_fused_projections_give_the_model_s_logits_and_keep_its_state_dict(arch):
    model = arch_model(arch)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    params = {k: id(v) for k, v in model.named_parameters()}
    fused = fuse_qkv(model)
    # Phi-3 stores its projections as one matrix already (qkv_proj): nothing to fuse
    assert fused == (0 if arch == "phi3" else model.config.num_hidden_layers)
    assert fuse_qkv(model) == 0  # fused modules are left as they are
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    assert {k: id(v) for k, v in model.named_parameters()} == params  # the same objects
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_weights_not_materialised_are_left_as_they_are():
    with torch.device("meta"):
        model = arch_model("llama3")
    assert fuse_qkv(model) == 0
    assert type(attention_modules(model)[0].q_proj) is torch.nn.Linear


def test_one_gemm_a_layer_reads_the_three_projections(monkeypatch):
    model = arch_model("qwen2", intermediate_size=80)  # biased projections; MLP rows apart
    fuse_qkv(model)
    calls = []
    linear = F.linear

    def spy(x, weight, bias=None):
        calls.append(weight.shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    with torch.no_grad():
        model(_ids())
    attn = attention_modules(model)[0]
    qkv = sum(getattr(attn, n).out_features for n in ("q_proj", "k_proj", "v_proj"))
    # per layer: the fused GEMM, o_proj, and the MLP's three
    assert calls.count(qkv) == model.config.num_hidden_layers
    assert len(calls) == 5 * model.config.num_hidden_layers + 1  # + lm_head
    assert all(m.q_proj.columns.pending is None for m in attention_modules(model))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5))
def test_key_and_value_of_other_hidden_states_are_their_own(seed, rows):
    model = arch_model("qwen2", seed=seed % 7)
    attn = attention_modules(model)[0]
    separate = {n: (getattr(attn, n).weight.clone(), getattr(attn, n).bias.clone())
                for n in ("q_proj", "k_proj", "v_proj")}
    fuse_qkv(model)
    assert isinstance(attn.q_proj, FusedQuery) and isinstance(attn.k_proj, FusedPart)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen)
    with torch.no_grad():
        attn.q_proj(x)  # leaves x's key and value columns
        for name in ("k_proj", "v_proj"):  # asked for y's: computed, not x's handed over
            torch.testing.assert_close(getattr(attn, name)(y), F.linear(y, *separate[name]))
        attn.q_proj(x)
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(getattr(attn, name)(x), F.linear(x, *separate[name]))


def test_gradients_reach_the_three_projections_as_unfused():
    model, ref = arch_model("qwen2", seed=4), arch_model("qwen2", seed=4)
    fuse_qkv(model)
    ids = _ids(4)
    for m in (model, ref):
        m(ids).logits.square().mean().backward()
    for name in ("q_proj", "k_proj", "v_proj"):
        for m, r in zip(attention_modules(model), attention_modules(ref), strict=True):
            for p in ("weight", "bias"):
                got = getattr(getattr(m, name), p).grad
                torch.testing.assert_close(got, getattr(getattr(r, name), p).grad)


def test_a_state_dict_loaded_after_fusing_reaches_the_fused_gemm():
    source, model = arch_model("llama3", seed=1), arch_model("llama3", seed=2)
    fuse_qkv(model)
    model.load_state_dict(source.state_dict())
    ids = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.usefixtures("exact_wave_step")
def test_a_fused_model_decodes_through_compiled_layers_as_the_unfused_one():
    model = arch_model("llama3", seed=3)
    ids, mask = left_padded([30, 45, 21], seed=3)
    new = 20  # update_tokens 8: the tails index segments twice
    want = generate(model, ids, DynamicCache(), attention_mask=mask, max_new_tokens=new,
                    do_sample=False, eos_token_id=None)
    fuse_qkv(model)
    torch._dynamo.reset()
    with WaveCache(CPU_WAVE, model, cuda_graphs=True, compile_layers=True) as cache:
        cache.store.executor.backend = "triton"
        out = generate(model, ids, cache, attention_mask=mask, max_new_tokens=new,
                       do_sample=False, eos_token_id=None)
    assert torch.equal(out, want)
    # the compiled steps took the fused GEMM's key and value columns
    assert all(m.q_proj.columns.pending is None for m in attention_modules(model))
