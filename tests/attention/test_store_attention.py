"""attention.StoreAttention: prefill, decode and continued prefill against exact attention."""

from __future__ import annotations

import pytest
import torch

from attention import StoreAttention
from tests.reference import rel_err
from vecstore import Store
from vecstore.errors import InvalidValueError, ShapeError

SMALL = {"index": {"tokens_per_cluster": 4, "segment_tokens": 64},
         "attention": {"sink_tokens": 2, "window_tokens": 6, "update_tokens": 8}}
EXACT = {**SMALL, "attention": {**SMALL["attention"], "retrieval_budget": 1.0}}


def _causal_reference(q, k, v, start):
    """Queries at positions ``start..`` over keys ``0..`` causally, float64. q [Hq, L, D]."""
    g = q.shape[0] // k.shape[0]
    kd, vd = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    logits = q.double() @ kd.transpose(1, 2) * q.shape[-1] ** -0.5
    pos_q = torch.arange(start, start + q.shape[1])[:, None]
    logits = logits.masked_fill(torch.arange(k.shape[1])[None, :] > pos_q, float("-inf"))
    return torch.softmax(logits, -1) @ vd


def _store_attention(store, batch, heads=(4, 2), dim=8, layers=1):
    seqs = [store.create(f"s{b}", num_layers=layers, num_kv_heads=heads[1], head_dim=dim,
                         dtype=torch.float32) for b in range(batch)]
    return StoreAttention(store, seqs)


@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (6, 6)])
def test_prefill_then_decode_at_full_budget_is_exact(heads):
    gen = torch.Generator().manual_seed(0)
    Hq, Hkv = heads
    T, steps, D = 60, 30, 8  # decode past update_tokens: new segments join the index
    q = torch.randn(1, Hq, T + steps, D, generator=gen)
    k = torch.randn(1, Hkv, T + steps, D, generator=gen)
    v = torch.randn(1, Hkv, T + steps, D, generator=gen)
    with Store.open(config=EXACT) as store:
        attn = _store_attention(store, 1, heads)
        out = attn(0, q[:, :, :T], k[:, :, :T], v[:, :, :T])
        assert rel_err(out[0], _causal_reference(q[0, :, :T], k[0, :, :T], v[0, :, :T], 0)) < 1e-5
        for t in range(T, T + steps):
            out = attn(0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
            ref = _causal_reference(q[0, :, t:t + 1], k[0, :, :t + 1], v[0, :, :t + 1], t)
            assert rel_err(out[0], ref) < 1e-5
        assert attn.seqs[0].num_tokens == T + steps
        assert len(attn.seqs[0].layers[0].segments) >= 2
        stats = attn.decode_stats
        assert stats.queries == steps and stats.exact_fraction == 1.0


def test_continued_prefill_merges_store_and_new_tokens_exactly():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 70, 8, generator=gen) for h in (4, 2, 2))
    with Store.open(config=EXACT) as store:
        attn = _store_attention(store, 1)
        attn(0, q[:, :, :50], k[:, :, :50], v[:, :, :50])
        out = attn(0, q[:, :, 50:], k[:, :, 50:], v[:, :, 50:])  # a second block: L = 20
        ref = _causal_reference(q[0, :, 50:], k[0], v[0], 50)
        assert rel_err(out[0], ref) < 1e-5
        assert attn.seqs[0].num_tokens == 70


def test_padding_is_neither_stored_nor_attended():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 40, 8, generator=gen) for h in (4, 2, 2))
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :15] = False
    with Store.open(config=EXACT) as store:
        attn = _store_attention(store, 2)
        out = attn(0, q, k, v, valid=valid)
        assert [s.num_tokens for s in attn.seqs] == [40, 25]
        ref = _causal_reference(q[1, :, 15:], k[1, :, 15:], v[1, :, 15:], 0)
        assert rel_err(out[1, :, 15:], ref) < 1e-5
        step = [torch.randn(2, h, 1, 8, generator=gen) for h in (4, 2, 2)]
        out = attn(0, *step)
        keys = torch.cat([k[1, :, 15:], step[1][1]], dim=1)
        values = torch.cat([v[1, :, 15:], step[2][1]], dim=1)
        assert rel_err(out[1], _causal_reference(step[0][1], keys, values, 25)) < 1e-5


def test_default_budgets_read_a_fraction_and_report_estimation():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 400, 8, generator=gen) for h in (4, 2, 2))
    with Store.open(config=SMALL) as store:
        attn = _store_attention(store, 1)
        attn(0, q[:, :, :399], k[:, :, :399], v[:, :, :399])
        attn(0, q[:, :, 399:], k[:, :, 399:], v[:, :, 399:])
        stats = attn.decode_stats
        assert stats.queries == 1 and 0.0 < stats.exact_fraction < 0.2
        assert 0.0 < stats.estimated_mass < 1.0


def test_misuse_is_rejected_before_anything_is_stored():
    with Store.open(config=SMALL) as store:
        with pytest.raises(InvalidValueError, match="at least one sequence"):
            StoreAttention(store, [])
        attn = _store_attention(store, 2)
        q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
        with pytest.raises(ShapeError, match="k: expected shape"):
            attn(0, q[:1], k[:1], v[:1])
        with pytest.raises(ShapeError, match="multiple of the 2 KV heads"):
            attn(0, torch.randn(2, 3, 3, 8), k, v)
        with pytest.raises(ShapeError, match="valid"):
            attn(0, q, k, v, valid=torch.ones(2, 4, dtype=torch.bool))
        assert [s.num_tokens for s in attn.seqs] == [0, 0]
