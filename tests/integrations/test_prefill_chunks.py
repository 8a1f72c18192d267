"""A prompt prefilled in chunks (benchmarks/e2e.py's prefill) gives the decode logits of a
one-pass prefill: through the wave cache at a full budget, and through DynamicCache."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import DynamicCache

from benchmarks.e2e import chunk_length, prefill
from integrations.hf import WaveCache
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import EXACT, tiny_model

batch_module = importlib.import_module("vecstore.engine.batch")


def _decode_logits(model, cache, ids, chunk, steps=4):
    logits = [prefill(model, cache, ids, chunk)]
    with torch.no_grad():
        for _ in range(steps):
            nxt = logits[-1].argmax(-1)
            out = model(input_ids=nxt, use_cache=True, logits_to_keep=1,
                        **{cache_kwarg(model): cache})
            logits.append(out.logits[:, -1:])
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("kind", ["wave", "sdpa"])
def test_chunked_prefill_matches_one_pass(kind):
    model = tiny_model("llama", 4, 2)
    ids = torch.randint(3, 96, (2, 150), generator=torch.Generator().manual_seed(0))

    def cache():
        return WaveCache(EXACT, model) if kind == "wave" else DynamicCache()

    whole = _decode_logits(model, cache(), ids, ids.shape[1])
    c = cache()
    chunked = _decode_logits(model, c, ids, 64)  # 64, 64, 22 tokens per row
    assert c.get_seq_length() == ids.shape[1] + 4
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


def test_chunk_length():
    assert chunk_length(1, 16384, 131072) == 16384
    assert chunk_length(8, 16384, 131072) == 2048
    assert chunk_length(64, 16, 1000) == 1
    assert chunk_length(4, 0, 1000) == 1000


def test_a_pinned_batch_prefilled_in_chunks_decodes_from_its_own_rows(monkeypatch):
    # the rows placed by the prompt's chunks are the batch's stack: no decode step copies
    # them into another (they were copied whole at the first step before)
    model = tiny_model("llama", 4, 2)
    ids = torch.randint(3, 96, (2, 150), generator=torch.Generator().manual_seed(1))
    want = _decode_logits(model, WaveCache(EXACT, model), ids, 64)
    stacks: list[tuple[int, ...]] = []
    growable = batch_module.growable_rows

    def spy(tier, shape, *args, **kwargs):
        stacks.append(tuple(shape))
        return growable(tier, shape, *args, **kwargs)

    monkeypatch.setattr(batch_module, "growable_rows", spy)
    cache = WaveCache({**EXACT, "kvstore": {"kind": "pinned"}}, model)
    got = _decode_logits(model, cache, ids, 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert stacks == []
    seqs = cache.sequences
    for layer in range(2):
        keys = [s.layers[layer].rows.keys for s in seqs]
        assert keys[1].data_ptr() > keys[0].data_ptr()
        assert keys[0].untyped_storage().data_ptr() == keys[1].untyped_storage().data_ptr()
