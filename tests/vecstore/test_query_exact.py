"""A 100% retrieval budget is exact attention, for every index, shape and GQA ratio."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.reference import exact_attention, rel_err
from vecstore import Store
from vecstore.index import INDEXES

SMALL = {"index": {"tokens_per_cluster": 4, "segment_tokens": 64},
         "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 7,
                       "retrieval_budget": 1.0}}


def _config(kind: str) -> dict:
    return {**SMALL, "index": {**SMALL["index"], "kind": kind}}


@pytest.mark.parametrize("kind", INDEXES.names())
@given(kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
       tokens=st.integers(1, 300), q_len=st.integers(1, 3), dim=st.sampled_from([4, 8, 12]),
       seed=st.integers(0, 2**16))
def test_full_budget_equals_exact_attention(kind, kv_heads, group, tokens, q_len, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(kv_heads, tokens, dim, generator=gen)
    values = torch.randn(kv_heads, tokens, dim, generator=gen)
    q = torch.randn(kv_heads * group, q_len, dim, generator=gen)
    with Store.open(config=_config(kind)) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=kv_heads, head_dim=dim,
                           dtype=torch.float32)
        seq.append(0, keys, values)
        res = seq.query(0, q)
    ref_out, ref_lse = exact_attention(q, keys, values)
    assert rel_err(res.out, ref_out) < 1e-5
    assert rel_err(res.lse, ref_lse) < 1e-5
    assert res.stats.tokens_exact == res.stats.tokens_total == tokens


@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=12), seed=st.integers(0, 999))
def test_decode_growth_keeps_every_token(chunks, seed):
    """Appends in pieces (prefill then decode) index segments as they fill, losing nothing."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(chunks)
    keys = torch.randn(2, total, 8, generator=gen)
    values = torch.randn(2, total, 8, generator=gen)
    q = torch.randn(4, 1, 8, generator=gen)
    with Store.open(config=_config("wave")) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        at = 0
        for n in chunks:
            seq.append(0, keys[:, at:at + n], values[:, at:at + n])
            at += n
        layer = seq.layers[0]
        res = seq.query(0, q)
    assert seq.num_tokens == total
    a = SMALL["attention"]
    assert layer.pending_keys.shape[1] < a["window_tokens"] + a["update_tokens"]
    starts = [s.start for s in layer.segments]
    assert starts == sorted(starts)
    assert rel_err(res.out, exact_attention(q, keys, values)[0]) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_is_safe_with_large_logits(dtype, tol):
    """Scores far beyond fp16's exp range neither overflow nor lose the exact result."""
    gen = torch.Generator().manual_seed(0)
    keys = (20 * torch.randn(2, 200, 16, generator=gen)).to(dtype)
    values = torch.randn(2, 200, 16, generator=gen).to(dtype)
    q = (20 * torch.randn(4, 1, 16, generator=gen)).to(dtype)
    with Store.open(config=_config("wave")) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=16, dtype=dtype)
        seq.append(0, keys, values)
        res = seq.query(0, q)
    assert res.out.dtype == dtype
    assert torch.isfinite(res.out).all() and torch.isfinite(res.lse).all()
    assert rel_err(res.out, exact_attention(q, keys, values)[0]) < tol


def test_batched_query_equals_per_sequence_queries():
    gen = torch.Generator().manual_seed(3)
    cfg = {**_config("wave"), "attention": {**SMALL["attention"], "retrieval_budget": 0.2,
                                            "estimation_budget": 0.5}}
    with Store.open(config=cfg) as store:
        seqs = []
        for i, n in enumerate([5, 90, 257]):
            s = store.create(f"s{i}", num_layers=2, num_kv_heads=2, head_dim=8,
                             dtype=torch.float32)
            for layer in range(2):
                s.append(layer, torch.randn(2, n, 8, generator=gen),
                         torch.randn(2, n, 8, generator=gen))
            seqs.append(s)
        q = torch.randn(3, 6, 2, 8, generator=gen)
        batched = store.query(seqs, 1, q)
        for b, s in enumerate(seqs):
            single = s.query(1, q[b])
            assert torch.allclose(batched.out[b], single.out, atol=1e-5)
            assert torch.allclose(batched.lse[b], single.lse, atol=1e-5)
        assert batched.stats.tokens_total == 5 + 90 + 257
