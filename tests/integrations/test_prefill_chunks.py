"""A prompt prefilled in chunks (benchmarks/e2e.py's prefill) gives the decode logits of a
one-pass prefill: through the wave cache at a full budget, and through DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from benchmarks.e2e import chunk_length, prefill
from integrations.hf import WaveCache
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import EXACT, tiny_model


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
