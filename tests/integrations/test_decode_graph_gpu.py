"""The WaveCache's decode forward captured as one CUDA graph, with the compiled kernels
(skipped without a CUDA device): the same tokens as the ordinary steps across segment
flushes with a left-padded batch, and a replayed step that never synchronises."""

from __future__ import annotations

import pytest
import torch

from integrations.hf import WaveCache
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import generate, left_padded, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CFG = {"index": {"tokens_per_cluster": 8, "segment_tokens": 256},
       "attention": {"sink_tokens": 4, "window_tokens": 16, "update_tokens": 64},
       "executor": {"device": "cuda"}}  # kind "auto": the wave executor on CUDA


def _model() -> torch.nn.Module:
    return tiny_model("llama", 4, 2, seed=3, layers=3).to("cuda", torch.bfloat16)  # D = 16


def test_captured_forward_equals_ordinary_steps_across_flushes():
    model = _model()
    ids, mask = left_padded([500, 700, 313, 600], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    new = 150  # two flushes of the tails
    runs, stats = {}, {}
    for graphs in (False, True):
        with WaveCache(CFG, model, cuda_graphs=graphs) as cache:
            runs[graphs] = generate(model, ids, cache, attention_mask=mask,
                                    max_new_tokens=new, do_sample=False, eos_token_id=None)
            stats[graphs] = cache.decode_stats
            assert stats[graphs].queries == (new - 1) * 3
            if graphs:
                assert cache.graph.captures >= 3 and cache.graph.static_steps >= new - 10
    assert torch.equal(runs[True], runs[False])
    # the captured steps count in one fused kernel a layer what ordinary steps count in torch
    counts = ("queries", "tokens_total", "tokens_exact")
    assert [getattr(stats[True], f) for f in counts] == [getattr(stats[False], f) for f in counts]
    assert stats[False].estimated_mass > 0
    assert stats[True].estimated_mass == pytest.approx(stats[False].estimated_mass, rel=1e-4)


def test_replayed_step_does_not_synchronise():
    model = _model()
    ids, mask = left_padded([600, 800], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    kw = cache_kwarg(model)
    with WaveCache(CFG, model) as cache, torch.no_grad():
        assert cache.graph is not None  # on by default on CUDA
        model(ids, attention_mask=mask, use_cache=True, **{kw: cache})
        nxt = ids[:, -1:]
        pos = mask.sum(1, keepdim=True)
        for step in range(4):
            model(nxt, position_ids=pos + step, use_cache=True, **{kw: cache})
        assert cache.graph.captures == 1
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(4, 8):
                out = model(nxt, position_ids=pos + step, use_cache=True, **{kw: cache})
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(out.logits).all()
        assert cache.graph.static_steps == 7


def _teacher_forced_logits(model, ids, mask, tokens, compile_layers):
    """Each decode step's logits ``[B, T, V]`` when the steps are fed ``tokens [B, T]``."""
    kw = cache_kwarg(model)
    with WaveCache(CFG, model, compile_layers=compile_layers) as cache, torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{kw: cache})
        pos = mask.sum(1, keepdim=True)
        logits = [model(tokens[:, t:t + 1], position_ids=pos + t, use_cache=True,
                        **{kw: cache}).logits[:, -1].float() for t in range(tokens.shape[1])]
        steps = cache.graph.static_steps
    return torch.stack(logits, 1), steps


def test_compiled_layers_in_the_captured_forward_match_the_layers_as_they_are():
    model = _model()
    ids, mask = left_padded([500, 700, 313, 600], seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    tokens = torch.randint(3, 96, (4, 150), device="cuda")  # two flushes of the tails
    plain, n_plain = _teacher_forced_logits(model, ids, mask, tokens, False)
    fused, n_fused = _teacher_forced_logits(model, ids, mask, tokens, True)
    assert n_fused == n_plain >= 140
    # Inductor rounds the fused norms' bf16 outputs its own way: close, not identical
    torch.testing.assert_close(fused, plain, atol=0.05, rtol=0.05)
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() > 0.95
