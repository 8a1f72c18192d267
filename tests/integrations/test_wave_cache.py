"""WaveCache with tiny random Llama and Qwen2 models: exactness at a 100% budget, batches
with left padding, GQA ratios, decoding past update_tokens, sampling, reuse of a store."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from integrations.hf import WaveCache
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import EXACT, SMALL, generate, left_padded, tiny_model
from vecstore import Store


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (4, 4)])
def test_full_budget_matches_dynamic_cache_with_left_padded_batch(arch, heads):
    model = tiny_model(arch, *heads)
    lengths = [60, 100, 37]
    ids, mask = left_padded(lengths)
    new = 40  # more than update_tokens (16): decode tokens are clustered into new segments
    ref = generate(model, ids, DynamicCache(), attention_mask=mask, max_new_tokens=new,
                   do_sample=False, eos_token_id=None)
    with WaveCache(EXACT, model) as cache:
        out = generate(model, ids, cache, attention_mask=mask, max_new_tokens=new,
                       do_sample=False, eos_token_id=None)
        assert torch.equal(out, ref)
        seqs = cache.sequences
        assert [s.name for s in seqs] == [f"{cache.name}.{b}" for b in range(3)]
        # padding is never stored; every position is counted by get_seq_length
        assert [s.num_tokens for s in seqs] == [n + new - 1 for n in lengths]
        assert cache.get_seq_length() == ids.shape[1] + new - 1
        assert all(len(s.layers[1].segments) >= 2 for s in seqs)
        assert cache.decode_stats.queries == (new - 1) * 2


def test_sampled_decoding_matches_dynamic_cache_at_full_budget():
    model = tiny_model("qwen2", 4, 2, seed=3)
    ids, mask = left_padded([50, 80], seed=3)
    torch.manual_seed(7)
    ref = generate(model, ids, DynamicCache(), attention_mask=mask, max_new_tokens=25,
                   do_sample=True, top_k=20, temperature=1.3)
    torch.manual_seed(7)
    with WaveCache(EXACT, model) as cache:
        out = generate(model, ids, cache, attention_mask=mask, max_new_tokens=25,
                       do_sample=True, top_k=20, temperature=1.3)
    assert torch.equal(out, ref)


def test_default_budgets_read_part_of_the_context():
    model = tiny_model("llama", 4, 2)
    ids, _ = left_padded([300])
    with WaveCache(SMALL, model) as cache:
        generate(model, ids, cache, max_new_tokens=5, do_sample=False, eos_token_id=None)
        stats = cache.decode_stats
        assert stats.queries == 4 * 2
        assert 0.0 < stats.exact_fraction < 0.25
        assert 0.0 < stats.estimated_mass < 1.0


def test_short_context_stays_exact_with_default_config():
    model = tiny_model("llama", 4, 2)
    ids, _ = left_padded([40])
    ref = generate(model, ids, DynamicCache(), max_new_tokens=8, do_sample=False)
    with WaveCache(None, model) as cache:
        assert torch.equal(generate(model, ids, cache, max_new_tokens=8, do_sample=False), ref)
        assert cache.decode_stats.exact_fraction == 1.0


def _doc_and_question(seed):
    doc, _ = left_padded([120], seed=seed)
    question = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(seed))
    return doc, torch.cat([doc, question], dim=1)


def _prefill(model, ids, cache):
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kwarg(model): cache})


def test_continue_from_a_stored_sequence_without_prefilling_again():
    model = tiny_model("llama", 4, 2, seed=5)
    doc, full = _doc_and_question(5)
    ref = generate(model, full, DynamicCache(), max_new_tokens=20, do_sample=False,
                   eos_token_id=None)
    with Store.open(config=EXACT) as store:
        with WaveCache(store, model, name="doc") as cache:
            _prefill(model, doc, cache)
        assert store.sequence("doc").num_tokens == 120
        with WaveCache.from_store(store, "doc", model) as cache:
            assert cache.get_seq_length() == 120
            # the full ids are passed; generate feeds only those past get_seq_length()
            out = generate(model, full, cache, max_new_tokens=20, do_sample=False,
                           eos_token_id=None)
        assert torch.equal(out, ref)
        assert store.sequence("doc").num_tokens == 120 + 10 + 19
        store.check_open()  # a store passed in is left open


def test_persisted_store_is_reused_after_reopening(tmp_path):
    model = tiny_model("qwen2", 4, 2, seed=8)
    doc, full = _doc_and_question(8)
    ref = generate(model, full, DynamicCache(), max_new_tokens=12, do_sample=False,
                   eos_token_id=None)
    with Store.open(tmp_path / "kv", config=EXACT) as store:
        with WaveCache(store, model, name="doc") as cache:
            _prefill(model, doc, cache)
    with WaveCache.from_store(tmp_path / "kv", "doc", model, config=EXACT) as cache:
        assert cache.get_seq_length() == 120
        out = generate(model, full, cache, max_new_tokens=12, do_sample=False,
                       eos_token_id=None)
    assert torch.equal(out, ref)


def test_beams_free_the_prefill_mirror_of_pinned_rows():
    model = tiny_model("llama", 4, 2, seed=6)
    ids, _ = left_padded([90, 90], seed=6)
    config = {**EXACT, "kvstore": {"kind": "pinned"},
              "attention": {**EXACT["attention"], "prefill_mirror_gb": 1.0}}
    with WaveCache(config, model) as cache:
        for part in (ids[:, :70], ids[:, 70:]):  # two chunks: the second reads the mirror
            _prefill(model, part, cache)
        mirror = cache._attention.mirror
        assert mirror is not None and mirror.held_bytes > 0
        cache.reorder_cache(torch.tensor([1, 0]))  # beams attend without a prefill
        assert mirror.held_bytes == 0
