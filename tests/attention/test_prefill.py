"""attention.prefill: a prompt fed in chunks attends exactly to its stored prefix (whatever
the budgets), with padded rows of different lengths, GQA and rows in the pinned tier; and
the chunks are indexed in whole segments."""

from __future__ import annotations

import importlib

import pytest
import torch

from attention import StoreAttention
from tests.reference import rel_err
from vecstore import Store

# default budgets (a sparse decode reads ~2 % exactly); small zones so chunks get indexed
SMALL = {"index": {"tokens_per_cluster": 4, "segment_tokens": 64},
         "attention": {"sink_tokens": 2, "window_tokens": 6, "update_tokens": 8}}


def _reference(q, k, v, valid):
    """Causal attention of one row in float64 over its valid tokens only: q [Hq, T, D],
    k, v [Hkv, T, D], valid [T]; padded queries get zeros."""
    g = q.shape[0] // k.shape[0]
    kd, vd = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    logits = q.double() @ kd.transpose(1, 2) * q.shape[-1] ** -0.5
    T = q.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & valid[None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(logits, -1).nan_to_num(0.0) @ vd
    return out * valid[None, :, None]


def _qkv(B, T, heads, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    return (torch.randn(B, Hq, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen),
            torch.randn(B, Hkv, T, D, generator=gen))


def prefill_cuts(config, q, k, v, valid, cuts, *, between=None):
    """Prefill ``q, k, v`` through one StoreAttention in the chunks ``cuts`` delimits;
    ``between(i, attn)`` runs before chunk ``i``. Returns the outputs, the sequences and
    the attention (its store closed)."""
    B, Hkv, _, D = k.shape
    outs = []
    with Store.open(config=config) as store:
        seqs = [store.create(f"s{b}", num_layers=1, num_kv_heads=Hkv, head_dim=D,
                             dtype=k.dtype) for b in range(B)]
        attn = StoreAttention(store, seqs)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            if between is not None:
                between(i, attn)
            mask = None if valid is None else valid[:, a:b]
            outs.append(attn(0, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], valid=mask))
        assert attn.decode_stats.queries == 0  # prefill never queries the index
    return torch.cat(outs, dim=2), seqs, attn


def _chunked(config, q, k, v, valid, chunk):
    """Prefill ``q, k, v`` chunk by chunk through StoreAttention; returns the outputs
    and the sequences (store closed)."""
    T = k.shape[2]
    out, seqs, _ = prefill_cuts(config, q, k, v, valid, [*range(0, T, chunk), T])
    return out, seqs


@pytest.mark.parametrize("kind", ["memory", "pinned"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("group_gb", [4.0, 0.0])  # the batch in one call; row by row
def test_chunks_over_a_stored_prefix_are_exact_at_default_budgets(kind, heads, group_gb):
    lengths, T, chunk = [230, 171, 30], 230, 40  # row 2 is padding for three chunks
    q, k, v = _qkv(len(lengths), T, heads, seed=len(heads) + heads[1])
    valid = torch.arange(T)[None, :] >= torch.tensor([T - n for n in lengths])[:, None]
    config = {**SMALL, "kvstore": {"kind": kind},
              "attention": {**SMALL["attention"], "prefill_group_gb": group_gb}}
    out, seqs = _chunked(config, q, k, v, valid, chunk)
    for b, n in enumerate(lengths):
        assert rel_err(out[b], _reference(q[b], k[b], v[b], valid[b])) < 1e-5
        assert torch.equal(out[b, :, :T - n], torch.zeros_like(out[b, :, :T - n]))
        assert seqs[b].num_tokens == n
    # the prefix the later chunks read was indexed (rows in the tier), not only steady
    assert all(len(s.layers[0].segments) >= 2 for s in seqs[:2])


def test_padding_that_is_not_left_padding_is_skipped_too():
    q, k, v = _qkv(2, 90, (4, 2), seed=7)
    valid = torch.ones(2, 90, dtype=torch.bool)
    valid[0, 20:35] = False  # a hole inside the prompt
    valid[1, 70:] = False  # right padding
    out, seqs = _chunked(SMALL, q, k, v, valid, 30)
    for b in range(2):
        assert rel_err(out[b], _reference(q[b], k[b], v[b], valid[b])) < 1e-5
        assert torch.equal(out[b][:, ~valid[b]], torch.zeros_like(out[b][:, ~valid[b]]))
    assert [s.num_tokens for s in seqs] == [75, 70]


def test_bfloat16_chunks_match_a_one_pass_prefill():
    q, k, v = (t.bfloat16() for t in _qkv(2, 160, (4, 2), seed=3))
    chunked, _ = _chunked(SMALL, q, k, v, None, 48)
    whole, _ = _chunked(SMALL, q, k, v, None, 160)
    assert chunked.dtype == torch.bfloat16
    assert rel_err(chunked, whole) < 1e-2
    assert rel_err(chunked[0], _reference(q[0], k[0], v[0], torch.ones(160, dtype=torch.bool))
                   ) < 1e-2


def test_chunks_are_indexed_in_whole_segments_and_the_rest_at_the_first_decode():
    q, k, v = _qkv(1, 300, (4, 2), seed=5)
    with Store.open(config=SMALL) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        attn = StoreAttention(store, [seq])
        for s in range(0, 290, 29):  # 29-token chunks: smaller than a segment (64)
            attn(0, q[:, :, s:s + 29], k[:, :, s:s + 29], v[:, :, s:s + 29])
        state = seq.layers[0]
        assert [g.num_tokens for g in state.segments] == [64] * 4  # 290 - 2 sinks - 6
        assert state.pending_keys.shape[1] == 290 - 2 - 256
        attn(0, q[:, :, 290:291], k[:, :, 290:291], v[:, :, 290:291])  # a decode step
        assert state.pending_keys.shape[1] == 6 + 1  # the window (the rest was sealed), the token
        assert seq.num_tokens == 291


@pytest.mark.parametrize("kind", ["memory", "pinned"])
def test_kv_blocks_hold_every_stored_token_once_read_from_the_tier(kind):
    gen = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, 250, 8, generator=gen), torch.randn(2, 250, 8, generator=gen)
    with Store.open(config={**SMALL, "kvstore": {"kind": kind}}) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        for s in range(0, 250, 50):
            seq.append(0, k[:, s:s + 50], v[:, s:s + 50])
        blocks = seq.kv_blocks(0)
        rows = seq.layers[0].rows
        assert blocks[0][0].data_ptr() == rows.keys.data_ptr()  # the tier's rows, no copy
        keys = torch.cat([bk for bk, _ in blocks], dim=1)
        values = torch.cat([bv for _, bv in blocks], dim=1)
    # the same (key, value) pairs, in another order: sort by the first key coordinate
    for got, want in ((keys, k), (values, v)):
        order_got = keys[:, :, 0].argsort(dim=1)[..., None].expand_as(got)
        order_want = k[:, :, 0].argsort(dim=1)[..., None].expand_as(want)
        assert torch.equal(got.gather(1, order_got), want.gather(1, order_want))


@pytest.mark.parametrize("padded", [False, True])
def test_a_nan_key_in_a_prefill_chunk_raises_and_stores_nothing(padded):
    from vecstore.errors import InvalidValueError

    q, k, v = _qkv(2, 40, (4, 2))
    valid = torch.ones(2, 40, dtype=torch.bool)
    if padded:
        valid[1, :7] = False
    with Store.open(config=SMALL) as store:
        seqs = [store.create(f"s{b}", num_layers=1, num_kv_heads=2, head_dim=8,
                             dtype=torch.float32) for b in range(2)]
        attn = StoreAttention(store, seqs)
        attn(0, q[:, :, :20], k[:, :, :20], v[:, :, :20],
             valid=valid[:, :20] if padded else None)
        before = [s.num_tokens for s in seqs]
        bad = k[:, :, 20:].clone()
        bad[1, 0, 15, 3] = float("nan")
        with pytest.raises(InvalidValueError, match="keys: contains 1 NaN/Inf"):
            attn(0, q[:, :, 20:], bad, v[:, :, 20:], valid=valid[:, 20:] if padded else None)
        assert [s.num_tokens for s in seqs] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["memory", "pinned"])
def test_cuda_chunks_attended_by_flash_in_groups_are_exact(kind):
    lengths, T, chunk = [600, 451, 90], 600, 128
    q, k, v = _qkv(len(lengths), T, (8, 2), D=64, seed=11)
    valid = torch.arange(T)[None, :] >= torch.tensor([T - n for n in lengths])[:, None]
    # 200 KB a group: early chunks' rows together, a late chunk's a group a row
    config = {**SMALL, "kvstore": {"kind": kind}, "executor": {"device": "cuda"},
              "attention": {**SMALL["attention"], "prefill_group_gb": 200e3 / 2**30}}
    out, seqs = _chunked(config, *(t.cuda().bfloat16() for t in (q, k, v)), valid.cuda(),
                         chunk)
    for b, n in enumerate(lengths):
        want = _reference(*(t.bfloat16().float() for t in (q[b], k[b], v[b])), valid[b])
        assert rel_err(out[b].cpu(), want) < 2e-2
        assert seqs[b].num_tokens == n


@pytest.mark.parametrize("group_gb,calls_a_chunk", [(4.0, 1), (0.0, 3)])
def test_a_chunks_rows_attend_in_one_call_per_group(group_gb, calls_a_chunk, monkeypatch):
    # the module (``attention.prefill`` as an attribute is the function it exports)
    prefill_module = importlib.import_module("attention.prefill")
    calls = []
    attend = prefill_module.varlen_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return attend(q, *args, **kwargs)

    monkeypatch.setattr(prefill_module, "varlen_attention", counted)
    q, k, v = _qkv(3, 120, (4, 2), seed=2)
    config = {**SMALL, "attention": {**SMALL["attention"], "prefill_group_gb": group_gb}}
    _chunked(config, q, k, v, None, 40)
    # the first chunk has no stored prefix (one batched SDPA call); each later chunk's
    # three rows go in one call, or one call a row with groups of 0 bytes
    assert len(calls) == 2 * calls_a_chunk
    assert sum(calls) == 2 * 3 * 40
