"""The fixed-shape decode steps a WaveCache captures as one CUDA graph, run uncaptured on
the CPU with the fused step replaced by exact attention in torch (the kernels have tests of
their own; the compiled path runs under ``-m gpu``): the same tokens as the ordinary steps
and as DynamicCache across segment flushes with left-padded batches, no host sync, NaN/Inf
reported without storing the step, stats counted, and the model's forward restored."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from integrations.hf import WaveCache
from integrations.hf.cache import cache_kwarg
from integrations.hf.decode_graph import DecodeGraph
from tests.integrations.exact_decode import CPU_WAVE, exact_wave_step  # noqa: F401
from tests.integrations.hf_models import arch_model, generate, left_padded, tiny_model
from tests.syncs import HostSyncs
from vecstore.engine.decoder import flush_due
from vecstore.errors import InvalidValueError

pytestmark = pytest.mark.usefixtures("exact_wave_step")


def _wave(cache: WaveCache) -> None:
    cache.store.executor.backend = "triton"


def _decoding(model, cache: WaveCache, ids: torch.Tensor, mask: torch.Tensor,
              steps: int) -> None:
    """Prefill ``ids`` then decode ``steps`` steps of their last tokens (no positions)."""
    kw = cache_kwarg(model)
    _wave(cache)
    model(ids, attention_mask=mask, use_cache=True, **{kw: cache})
    for _ in range(steps):
        model(ids[:, -1:], use_cache=True, **{kw: cache})


@pytest.mark.parametrize(("arch", "lengths"), [("llama", [30, 45, 21]), ("qwen2", [40])])
def test_fixed_shape_steps_equal_ordinary_steps_across_flushes(arch, lengths):
    model = tiny_model(arch, 4, 2, seed=1)
    ids, mask = left_padded(lengths, seed=1)
    new = 30  # update_tokens 8: the tails index segments three times
    ref = generate(model, ids, DynamicCache(), attention_mask=mask, max_new_tokens=new,
                   do_sample=False, eos_token_id=None)
    runs, segments = {}, {}
    for graphs in (False, True):
        with WaveCache(CPU_WAVE, model, cuda_graphs=graphs) as cache:
            _wave(cache)
            runs[graphs] = generate(model, ids, cache, attention_mask=mask,
                                    max_new_tokens=new, do_sample=False, eos_token_id=None)
            seqs = cache.sequences
            assert [s.num_tokens for s in seqs] == [n + new - 1 for n in lengths]
            assert cache.get_seq_length() == ids.shape[1] + new - 1
            assert cache.decode_stats.queries == (new - 1) * 2
            segments[graphs] = [len(s.layers[0].segments) for s in seqs]
            if graphs:
                # ordinary: the step after the prefill and the 3 that index the tails
                assert cache.graph.static_steps == new - 1 - 4
    assert torch.equal(runs[True], ref) and torch.equal(runs[False], ref)
    assert segments[True] == segments[False] and min(segments[True]) >= 4


def test_soft_capped_fixed_shape_steps_equal_dynamic_cache():
    # Gemma 2 with its cap (every layer global, so the batch decodes in fixed-shape steps):
    # the cap reaches the fused step
    model = arch_model("gemma2", layer_types=["full_attention"] * 2)
    ids, mask = left_padded([30, 45], seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    ref = generate(model, ids, DynamicCache(config=model.config), **kwargs)
    with WaveCache(CPU_WAVE, model, cuda_graphs=True) as cache:
        _wave(cache)
        out = generate(model, ids, cache, **kwargs)
        assert cache.graph.static_steps > 0
    assert torch.equal(out, ref)


def test_fixed_shape_step_does_not_sync():
    model = tiny_model("llama", 4, 2, layers=3)
    ids, mask = left_padded([60, 75], seed=2)
    kw = cache_kwarg(model)
    with WaveCache(CPU_WAVE, model, cuda_graphs=True) as cache, torch.no_grad():
        _wave(cache)
        model(ids, attention_mask=mask, use_cache=True, **{kw: cache})
        nxt = ids[:, -1:]
        pos = mask.sum(1, keepdim=True)
        for step in range(3):  # ordinary (seals), first fixed-shape run, then steady
            model(nxt, position_ids=pos + step, use_cache=True, **{kw: cache})
        assert cache.graph.static_steps == 2
        with HostSyncs() as syncs:
            model(nxt, position_ids=pos + 3, use_cache=True, **{kw: cache})
        assert syncs.total == 0, dict(syncs.count)
        assert cache.graph.static_steps == 3
        stats = cache.decode_stats  # read back now
        assert stats.queries == 4 * 3  # one ordinary and three fixed-shape steps, 3 layers
        # each query counts the tokens its rows store, its own included
        assert stats.tokens_total == 3 * sum(60 + 75 + 2 * (t + 1) for t in range(4))


def _step_with(model, cache: WaveCache, nxt: torch.Tensor, value: float) -> None:
    """One decode step whose first row's token embeds as ``value`` everywhere."""
    embed = model.get_input_embeddings().weight
    saved = embed[nxt[0, 0]].clone()
    embed.data[nxt[0, 0]] = value
    try:
        model(nxt, use_cache=True, **{cache_kwarg(model): cache})
    finally:
        embed.data[nxt[0, 0]] = saved


def test_nan_step_is_reported_and_not_stored():
    model = tiny_model("llama", 4, 2)
    ids, mask = left_padded([50, 64], seed=4)
    kw = cache_kwarg(model)
    with WaveCache(CPU_WAVE, model, cuda_graphs=True) as cache, torch.no_grad():
        _decoding(model, cache, ids, mask, 3)
        nxt = ids[:, -1:]
        counts = [s.num_tokens for s in cache.sequences]
        seen = cache.get_seq_length()
        _step_with(model, cache, nxt, float("nan"))  # stored, found at the next step's start
        with pytest.raises(InvalidValueError, match="NaN or Inf.*1 token"):
            model(nxt, use_cache=True, **{kw: cache})
        assert [s.num_tokens for s in cache.sequences] == counts
        assert cache.get_seq_length() == seen
        assert all(torch.isfinite(s.layers[layer].steady()[0]).all()
                   for s in cache.sequences for layer in range(2))
        model(nxt, use_cache=True, **{kw: cache})  # decoding goes on
        assert [s.num_tokens for s in cache.sequences] == [n + 1 for n in counts]


def test_forward_is_restored_whatever_order_caches_close():
    model = tiny_model("llama", 4, 2)
    plain = model.forward
    a = WaveCache(CPU_WAVE, model, cuda_graphs=True)
    b = WaveCache(CPU_WAVE, model, cuda_graphs=True)
    assert isinstance(model.forward, DecodeGraph) and model.forward.forward is a.graph
    a.close()
    assert model.forward is b.graph and b.graph.forward == plain
    b.close()
    assert "forward" not in model.__dict__ and model.forward == plain
    with WaveCache(CPU_WAVE, model, cuda_graphs=False):
        assert "forward" not in model.__dict__


def test_inference_mode_decoding_then_stats_and_queries_outside():
    model = tiny_model("llama", 4, 2)
    ids, mask = left_padded([40, 40], seed=6)
    kw = cache_kwarg(model)
    with WaveCache(CPU_WAVE, model, cuda_graphs=True) as cache:
        with torch.inference_mode():  # buffers made here are inference tensors
            _decoding(model, cache, ids, mask, 4)
        assert cache.graph.static_steps == 3
        assert cache.decode_stats.queries == 4 * 2  # read outside inference mode
        assert cache.decode_stats.queries == 4 * 2  # and again: nothing counted twice
        with torch.no_grad():  # decoding goes on outside inference mode
            for _ in range(2):
                model(ids[:, -1:], use_cache=True, **{kw: cache})
        assert cache.decode_stats.queries == 6 * 2
        assert [s.num_tokens for s in cache.sequences] == [46, 46]


def test_nan_in_the_last_step_before_a_flush_is_reported_before_the_flush():
    model = tiny_model("llama", 4, 2)
    ids, mask = left_padded([40, 40], seed=7)
    kw = cache_kwarg(model)
    with WaveCache(CPU_WAVE, model, cuda_graphs=True) as cache, torch.no_grad():
        _decoding(model, cache, ids, mask, 1)
        nxt = ids[:, -1:]
        while True:  # fixed-shape steps until the next one is the last before a flush
            model(nxt, use_cache=True, **{kw: cache})
            dec = cache.graph.decoder
            if flush_due(dec.tail_tokens + 1, dec.window, dec.update):
                break
        counts = [s.num_tokens for s in cache.sequences]
        _step_with(model, cache, nxt, float("inf"))  # stored by a fixed-shape step
        assert dec.flush_due
        with pytest.raises(InvalidValueError, match="NaN or Inf"):
            model(nxt, use_cache=True, **{kw: cache})  # checked before the ordinary step
        assert [s.num_tokens for s in cache.sequences] == counts
        assert all(torch.isfinite(s.layers[0].steady()[0]).all() for s in cache.sequences)


def test_fixed_shape_steps_slice_no_tail_views(monkeypatch):
    # a step moves every row's tail on by a token; the views are sliced only when read (at
    # the next flush), not for every row and layer of every step
    from vecstore.engine.tail import TailBuffer

    model = tiny_model("llama", 4, 2, seed=2)
    ids, mask = left_padded([30, 25], seed=2)
    with WaveCache(CPU_WAVE, model, cuda_graphs=True) as cache:
        _decoding(model, cache, ids, mask, 3)  # prefill, then ordinary and first static steps
        sliced = []
        original = TailBuffer.row
        monkeypatch.setattr(TailBuffer, "row",
                            lambda self, b, n: sliced.append(b) or original(self, b, n))
        static = cache.graph.static_steps
        kw = cache_kwarg(model)
        for _ in range(3):
            assert not flush_due(cache.graph.decoder.tail_tokens, 4, 8)
            model(ids[:, -1:], use_cache=True, **{kw: cache})
        assert cache.graph.static_steps == static + 3 and sliced == []
        tails = [s.layers[0].pending_keys for s in cache.sequences]  # read: sliced now
        assert len(sliced) == 2 and [t.shape[1] for t in tails] == [tails[0].shape[1]] * 2
