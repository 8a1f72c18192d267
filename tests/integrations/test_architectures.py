"""Every tested architecture through WaveCache, token for token against DynamicCache at a
100% budget: greedy with a left-padded batch, beam search, assisted decoding. Prompts are
longer than the steady zone plus one update (indexed), and sliding windows slide."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from integrations.hf import WaveCache, cache_arg, model_shape
from tests.integrations.hf_models import ARCHITECTURES, EXACT, arch_model, generate, left_padded

NEW = 20  # decode steps past update_tokens (16): decode tokens are indexed too


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request):
    return request.param


def _both(model, ids, **kwargs):
    ref = generate(model, ids, DynamicCache(config=model.config), **kwargs)
    with WaveCache(EXACT, model) as cache:
        out = generate(model, ids, cache, **kwargs)
        return ref, out, cache.decode_stats, cache.sequences


def test_greedy_left_padded_batch_matches_dynamic_cache(arch):
    model = arch_model(arch)
    shape = model_shape(model)
    ids, mask = left_padded([40, 64], seed=1)
    ref, out, stats, seqs = _both(model, ids, attention_mask=mask, max_new_tokens=NEW,
                                  do_sample=False, eos_token_id=None)
    assert torch.equal(out, ref)
    windowed = {"mistral": (0, 1), "gemma2": (0,), "gemma3": (0,)}.get(arch, ())
    assert stats.windowed_layers == windowed == shape.windowed_layers
    store_layers = 2 - len(windowed)
    assert stats.queries == (NEW - 1) * store_layers
    assert stats.window_queries == (NEW - 1) * len(windowed)
    # a window layer attends to at most its window, never to the whole context
    assert 0 < stats.window_tokens <= stats.window_queries * 24 or not windowed
    if store_layers:
        assert stats.exact_fraction == 1.0
        assert [s.num_tokens for s in seqs] == [40 + NEW - 1, 64 + NEW - 1]
        assert all(len(s.layers[-1].segments) >= 2 for s in seqs)
        assert seqs[0].num_layers == store_layers


def test_gemma2_soft_capped_decode_logits_match_dynamic_cache():
    # what makes the Gemma 2 runs check the cap: it changes the tokens, and every decode
    # step's logits through the store match DynamicCache's (a store ignoring it would not)
    ids, mask = left_padded([40, 64], seed=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                  output_logits=True, return_dict_in_generate=True)
    capped, plain = arch_model("gemma2"), arch_model("gemma2", attn_logit_softcapping=None)
    assert capped.config.attn_logit_softcapping == 2.0
    ref = generate(capped, ids, DynamicCache(config=capped.config), **kwargs)
    uncapped = generate(plain, ids, DynamicCache(config=plain.config), **kwargs)
    assert not torch.equal(ref.sequences, uncapped.sequences)
    with WaveCache(EXACT, capped) as cache:
        out = generate(capped, ids, cache, **kwargs)
        assert cache.decode_stats.exact_fraction == 1.0
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits),
                               atol=1e-4, rtol=1e-4)


def test_beam_search_matches_dynamic_cache(arch):
    model = arch_model(arch)
    ids, mask = left_padded([30, 50], seed=2)
    ref, out, _, seqs = _both(model, ids, attention_mask=mask, max_new_tokens=10,
                              do_sample=False, eos_token_id=None, num_beams=2)
    assert torch.equal(out, ref)
    if model_shape(model).store_layers:
        # the beams of a prompt read one stored prefix: transformers' copy was dropped
        assert len(seqs) == 2 and all(s.num_tokens in (30, 50) for s in seqs)


def test_assisted_decoding_matches_dynamic_cache(arch):
    model, assistant = arch_model(arch), arch_model(arch, seed=9)
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    ids, _ = left_padded([40], seed=3)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                  assistant_model=assistant)
    ref, out, _, seqs = _both(model, ids, **kwargs)
    assert torch.equal(out, ref)
    # rejected draft tokens were cropped: the store holds exactly the accepted context
    assert all(s.num_tokens == 40 + NEW - 1 for s in seqs)




@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_row_operations_match_dynamic_cache(name):
    model = arch_model(name)
    ids, mask = left_padded([40, 64], seed=4)
    step = torch.randint(3, 96, (3, 1), generator=torch.Generator().manual_seed(4))

    def run(cache):
        with torch.no_grad():
            model(ids, attention_mask=mask, **cache_arg(model, cache))
            cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
            cache.batch_select_indices(torch.tensor([3, 0, 2]))  # rows 1, 0, 1
            rows = torch.cat([mask[[1, 0, 1]], torch.ones(3, 1, dtype=mask.dtype)], dim=1)
            return model(step, attention_mask=rows, **cache_arg(model, cache)).logits

    ref = run(DynamicCache(config=model.config))
    with WaveCache(EXACT, model) as cache:
        out = run(cache)
        assert len(cache.sequences) == 2
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
