"""Attention logit soft-capping (Gemma 2): every zone caps its scores, prefill too, and a
bad cap is refused naming the argument."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attention import StoreAttention, prefill
from attention.exact import capped_attention, sdpa
from tests.reference import exact_attention, rel_err
from vecstore import Store
from vecstore.config import StoreConfig
from vecstore.errors import InvalidValueError
from vecstore.executor.torch_ref import estimate_units
from vecstore.index.base import IndexView
from vecstore.index.wave import WaveIndex

SMALL = {"index": {"tokens_per_cluster": 4, "segment_tokens": 64},
         "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 7}}
EXACT = {**SMALL, "attention": {**SMALL["attention"], "retrieval_budget": 1.0}}


def _store_query(config, keys, values, q, softcap):
    with Store.open(config=config) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=keys.shape[0],
                           head_dim=keys.shape[-1], dtype=torch.float32)
        seq.append(0, keys, values)
        return seq.query(0, q, softcap=softcap)


@given(kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
       tokens=st.integers(1, 300), q_len=st.integers(1, 3), dim=st.sampled_from([4, 8, 16]),
       softcap=st.floats(0.25, 60.0), seed=st.integers(0, 2**16))
def test_full_budget_with_a_cap_equals_capped_exact_attention(kv_heads, group, tokens, q_len,
                                                               dim, softcap, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = 3.0 * torch.randn(kv_heads, tokens, dim, generator=gen)  # scores past small caps
    values = torch.randn(kv_heads, tokens, dim, generator=gen)
    q = torch.randn(kv_heads * group, q_len, dim, generator=gen)
    res = _store_query(EXACT, keys, values, q, softcap)
    ref_out, ref_lse = exact_attention(q, keys, values, softcap=softcap)
    assert rel_err(res.out, ref_out) < 1e-5
    assert rel_err(res.lse, ref_lse) < 1e-5
    assert res.stats.tokens_exact == res.stats.tokens_total == tokens


def test_the_cap_changes_the_answer():
    gen = torch.Generator().manual_seed(0)
    keys = 3.0 * torch.randn(2, 200, 8, generator=gen)
    values = torch.randn(2, 200, 8, generator=gen)
    q = torch.randn(4, 1, 8, generator=gen)
    capped = _store_query(EXACT, keys, values, q, 1.0)
    plain = _store_query(EXACT, keys, values, q, None)
    assert rel_err(capped.out, plain.out) > 0.1
    # a sparse budget (retrieved + estimated clusters) caps too: closer to the capped answer
    sparse = _store_query({**SMALL, "attention": {**SMALL["attention"], "retrieval_budget": 0.3,
                                                  "estimation_budget": 1.0}},
                          keys, values, q, 1.0)
    ref_out, _ = exact_attention(q, keys, values, softcap=1.0)
    assert rel_err(sparse.out, ref_out) < rel_err(plain.out, ref_out)
    assert sparse.stats.units_estimated > 0


@given(heads=st.integers(1, 3), distinct=st.integers(1, 12), repeat=st.integers(1, 6),
       group=st.sampled_from([1, 2, 4]), softcap=st.floats(0.25, 60.0),
       seed=st.integers(0, 9999))
def test_capped_estimate_is_exact_for_clusters_of_identical_keys(heads, distinct, repeat, group,
                                                                 softcap, seed):
    # the centroid's score is capped as its keys' are: exact where keys equal their mean
    gen = torch.Generator().manual_seed(seed)
    keys = (3.0 * torch.randn(heads, distinct, 8, generator=gen)).repeat_interleave(repeat, 1)
    values = torch.randn(heads, distinct * repeat, 8, generator=gen)
    q = torch.randn(heads * group, 1, 8, generator=gen)
    cfg = StoreConfig.from_dict({"index": {"tokens_per_cluster": repeat,
                                           "segment_tokens": 4096}})
    index = WaveIndex(cfg)
    view = IndexView.from_segments(index.build(keys, values, 0))
    every = torch.arange(view.sizes.shape[-1])[None, None].expand(1, heads, -1)
    ids = every.masked_fill(view.sizes == 0, -1)
    out, lse = estimate_units(view, index.summarize(view), ids,
                              q.reshape(1, heads, group, 1, 8), 8 ** -0.5, softcap)
    ref_out, ref_lse = exact_attention(q, keys, values, softcap=softcap)
    assert rel_err(out.reshape(heads * group, 1, 8), ref_out) < 1e-4
    assert torch.allclose(lse.reshape(heads * group, 1).double(), ref_lse, atol=1e-4)


@given(tokens=st.integers(2, 200), tpc=st.integers(1, 20), softcap=st.floats(0.25, 60.0),
       seed=st.integers(0, 9999))
def test_capped_estimate_is_a_lower_bound_where_every_score_is_negative(tokens, tpc, softcap,
                                                                       seed):
    # e^{cap(x)} is convex for x <= 0: Jensen's lower bound holds for keys scoring <= 0
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 8, generator=gen)
    keys = 3.0 * torch.randn(1, tokens, 8, generator=gen)
    keys = torch.where((keys @ q[0, 0] > 0)[..., None], -keys, keys)
    values = torch.randn(1, tokens, 8, generator=gen)
    cfg = StoreConfig.from_dict({"index": {"tokens_per_cluster": tpc, "segment_tokens": 4096}})
    index = WaveIndex(cfg)
    view = IndexView.from_segments(index.build(keys, values, 0))
    ids = torch.arange(view.sizes.shape[-1])[None, None].masked_fill(view.sizes == 0, -1)
    _, lse_est = estimate_units(view, index.summarize(view), ids, q.reshape(1, 1, 1, 1, 8),
                                8 ** -0.5, softcap)
    _, lse_true = exact_attention(q, keys, values, softcap=softcap)
    assert (lse_est.reshape(1, 1).double() <= lse_true + 1e-4).all()


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.inf, math.nan, True, "50"])
def test_a_bad_softcap_is_refused_naming_it(bad):
    keys = torch.randn(1, 10, 8)
    with Store.open() as store:
        seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
        seq.append(0, keys, keys)
        with pytest.raises(InvalidValueError, match=r"^softcap: expected None or a positive"):
            store.query([seq], 0, torch.randn(1, 1, 1, 8), softcap=bad)
        with pytest.raises(InvalidValueError, match=r"^softcap:"):
            seq.query(0, torch.randn(1, 1, 8), softcap=bad)
        attn = StoreAttention(store, [seq])
        q = torch.randn(1, 1, 1, 8)
        with pytest.raises(InvalidValueError, match=r"^softcap:"):
            attn(0, q, q, q, softcap=bad)
        assert seq.num_tokens == 10  # refused before anything was stored


def _causal_reference(q, k, v, valid, softcap):
    """Causal soft-capped attention of one row in float64 over its valid tokens: q [Hq, T, D],
    k, v [Hkv, T, D], valid [T]; padded queries get zeros."""
    g = q.shape[0] // k.shape[0]
    kd, vd = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    logits = q.double() @ kd.transpose(1, 2) * q.shape[-1] ** -0.5
    logits = softcap * torch.tanh(logits / softcap)
    T = q.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & valid[None, :]
    out = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) @ vd
    return out * valid[None, :, None]


@pytest.mark.parametrize("chunk", [40, 16], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("padded", [False, True])
def test_prefill_with_a_cap_equals_capped_causal_attention(chunk, padded):
    # one pass over empty rows (sdpa's case), chunks over a stored prefix (the lower-right
    # case), left-padded rows (row by row): each capped
    gen = torch.Generator().manual_seed(3)
    B, T, D, cap = 2, 40, 8, 1.5
    q = 3.0 * torch.randn(B, 4, T, D, generator=gen)
    k, v = torch.randn(B, 2, T, D, generator=gen), torch.randn(B, 2, T, D, generator=gen)
    valid = torch.ones(B, T, dtype=torch.bool)
    if padded:
        valid[1, :13] = False
    outs = []
    with Store.open(config=SMALL) as store:
        seqs = [store.create(f"r{b}", num_layers=1, num_kv_heads=2, head_dim=D,
                             dtype=torch.float32) for b in range(B)]
        for i in range(0, T, chunk):
            part = slice(i, i + chunk)
            outs.append(prefill(store, seqs, 0, q[:, :, part], k[:, :, part], v[:, :, part],
                                scale=D ** -0.5, valid=valid[:, part] if padded else None,
                                softcap=cap))
        out = torch.cat(outs, dim=2)
        assert [s.num_tokens for s in seqs] == valid.sum(1).tolist()
    for b in range(B):
        ref = _causal_reference(q[b], k[b], v[b], valid[b], cap)
        assert rel_err(out[b], ref) < 1e-5
    plain = sdpa(q, k, v, scale=D ** -0.5)
    assert rel_err(out[0], plain[0]) > 0.05  # the cap mattered


def test_capped_attention_slices_the_queries(monkeypatch):
    import vecstore.slicing

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=gen), torch.randn(1, 1, 12, 8, generator=gen),
               torch.randn(1, 1, 12, 8, generator=gen))
    whole = capped_attention(q, k, v, scale=0.5, softcap=2.0)
    monkeypatch.setattr(vecstore.slicing, "SCORE_BUDGET", 2 * 12 * 2)  # two queries a slice
    assert torch.allclose(capped_attention(q, k, v, scale=0.5, softcap=2.0), whole, atol=1e-6)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None, 3:]
    ref = capped_attention(q, k, v, scale=0.5, softcap=2.0, mask=mask)  # lower-right, explicit
    assert torch.allclose(ref, whole, atol=1e-6)
