"""attention.prefix_mirror: offloaded rows' stored prefixes kept on the device across a
prompt's prefill chunks give the same attention as reading them from the tier every chunk,
are really read instead of the tier, are rebuilt when stale, stay within their bound (rows
that do not fit are read from the tier) and are freed by the first decode step."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention import StoreAttention, prefill
from attention.prefix_mirror import PrefixMirror
from tests.attention.test_prefill import SMALL, _qkv, _reference, prefill_cuts
from tests.reference import rel_err
from vecstore import Store
from vecstore.engine.sequence import Sequence

prefill_module = importlib.import_module("attention.prefill")

LENGTHS, T = [230, 171, 30], 230  # left padding: row 2 is padding for most chunks


def _config(mirror_gb: float, kind: str = "pinned") -> dict:
    return {**SMALL, "kvstore": {"kind": kind},
            "attention": {**SMALL["attention"], "prefill_mirror_gb": mirror_gb}}


def _valid(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] >= torch.tensor([T - n for n in lengths])[:, None]


def _run(config, q, k, v, valid, cuts, *, between=None):
    """Prefill ``q, k, v`` in the chunks ``cuts`` delimits (:func:`prefill_cuts`);
    returns the outputs and the attention (its store closed)."""
    out, seqs, attn = prefill_cuts(config, q, k, v, valid, cuts, between=between)
    # the later chunks' prefix was indexed between them (rows in the tier)
    assert all(len(s.layers[0].segments) >= 2 for s in seqs if s.num_tokens >= 150)
    return out, attn


@pytest.fixture
def reads(monkeypatch):
    """The sequences (by name) whose ``kv_blocks`` were read, in order."""
    names: list[str] = []
    kv_blocks = Sequence.kv_blocks

    def spy(self, layer):
        names.append(self.name)
        return kv_blocks(self, layer)

    monkeypatch.setattr(Sequence, "kv_blocks", spy)
    return names


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, T - 1), max_size=6, unique=True).map(
    lambda inner: [0, *sorted(inner), T]).filter(  # a one-token step is a decode step
    lambda cuts: all(b - a >= 2 for a, b in zip(cuts, cuts[1:], strict=False))),
    heads=st.sampled_from([(6, 2), (4, 4), (8, 1)]))
def test_random_chunks_with_the_mirror_match_the_tier_and_the_reference(cuts, heads):
    q, k, v = _qkv(len(LENGTHS), T, heads, seed=len(cuts))
    valid = _valid(LENGTHS, T)
    mirrored, attn = _run(_config(1.0), q, k, v, valid, cuts)
    tier, _ = _run(_config(0.0), q, k, v, valid, cuts)
    assert attn.mirror is not None and attn.mirror.held_bytes > 0
    assert torch.allclose(mirrored, tier, atol=1e-6)
    for b in range(len(LENGTHS)):
        assert rel_err(mirrored[b], _reference(q[b], k[b], v[b], valid[b])) < 1e-5


def test_chunks_in_the_mirror_match_a_one_pass_prefill_without_padding():
    q, k, v = _qkv(2, 200, (4, 2), seed=4)
    cuts = [0, 50, 64, 129, 200]  # chunks across segment boundaries (64 tokens)
    chunked, _ = _run(_config(1.0), q, k, v, None, cuts)
    whole, _ = _run(_config(0.0), q, k, v, None, [0, 200])
    assert torch.allclose(chunked, whole, atol=1e-6)


@pytest.mark.parametrize("mirror_gb,tier_reads", [
    (1.0, 0),  # every row in the mirror: the tier is never read
    # row 0 reads it in each of the 6 chunks, row 1 from the second, row 2 in the last
    (1e-9, 6 + 5 + 1),  # no room
    (0.0, 6 + 5 + 1),  # off
])
def test_the_mirror_is_read_instead_of_the_tier(mirror_gb, tier_reads, reads):
    q, k, v = _qkv(len(LENGTHS), T, (4, 2), seed=1)
    valid = _valid(LENGTHS, T)
    out, attn = _run(_config(mirror_gb), q, k, v, valid, [0, 40, 80, 120, 160, 200, T])
    assert len(reads) == tier_reads
    if mirror_gb == 1.0:
        assert attn.mirror is not None and attn.mirror.held_bytes >= 2 * 2 * 8 * 4 * sum(LENGTHS)
    for b in range(len(LENGTHS)):
        assert rel_err(out[b], _reference(q[b], k[b], v[b], valid[b])) < 1e-5


def test_a_resident_tier_never_uses_the_mirror(reads):
    q, k, v = _qkv(len(LENGTHS), T, (4, 2), seed=2)
    valid = _valid(LENGTHS, T)
    out, attn = _run(_config(1.0, kind="memory"), q, k, v, valid, [0, 100, 200, T])
    assert attn.mirror is not None and attn.mirror.held_bytes == 0
    assert reads.count("s0") == 3  # every chunk (padded: the first goes row by row too)
    assert rel_err(out[0], _reference(q[0], k[0], v[0], valid[0])) < 1e-5


def test_tokens_appended_between_chunks_rebuild_the_mirror(reads):
    q, k, v = _qkv(1, T, (4, 2), seed=3)
    eq, ek, ev = _qkv(1, 20, (4, 2), seed=13)  # stored directly, not through the attention

    def between(i, attn):
        if i == 2:
            attn.seqs[0].append(0, ek[0], ev[0])

    out, _ = _run(_config(1.0), q, k, v, None, [0, 60, 100, 170, T], between=between)
    assert reads == ["s0"]  # the chunk after the append rebuilt the row's entry
    whole = [torch.cat([x[0, :, :100], e[0], x[0, :, 100:]], dim=1)
             for x, e in ((q, eq), (k, ek), (v, ev))]
    want = _reference(*whole, torch.ones(T + 20, dtype=torch.bool))
    assert rel_err(out[0], torch.cat([want[:, :100], want[:, 120:]], dim=1)) < 1e-5


@pytest.mark.parametrize("failure", ["ingestion", "nan"])
def test_a_failed_chunk_never_leaves_a_stale_mirror(monkeypatch, reads, failure):
    # the mirror takes the chunk before it is stored: an ingestion that fails, or a NaN/Inf
    # found after the attention's launch, leaves the store as it was and the retry rebuilds
    # both rows' entries, once
    from vecstore.errors import InvalidValueError

    q, k, v = _qkv(2, 160, (4, 2), seed=5)
    bad, ingest, calls = v.clone(), prefill_module.ingest, []
    bad[1, 0, 70, 2] = float("inf")

    def flaky(*args, **kwargs):
        calls.append(True)
        if len(calls) == 2:
            raise RuntimeError("ingestion failed")
        return ingest(*args, **kwargs)

    if failure == "ingestion":
        monkeypatch.setattr(prefill_module, "ingest", flaky)
    error = (RuntimeError, "ingestion failed") if failure == "ingestion" else (
        InvalidValueError, "values: contains 1 NaN/Inf")
    outs = []
    with Store.open(config=_config(1.0)) as store:
        seqs = [store.create(f"s{b}", num_layers=1, num_kv_heads=2, head_dim=8,
                             dtype=torch.float32) for b in range(2)]
        attn = StoreAttention(store, seqs)
        for a, b in [(0, 50), (50, 100), (100, 160)]:
            if a == 50:
                with pytest.raises(error[0], match=error[1]):
                    attn(0, q[:, :, a:b], k[:, :, a:b], (bad if failure == "nan" else v)[:, :, a:b])
                assert [s.num_tokens for s in seqs] == [50, 50] and reads == []
            outs.append(attn(0, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]))
    assert reads == ["s0", "s1"]
    out = torch.cat(outs, dim=2)
    for b in range(2):
        assert rel_err(out[b], _reference(q[b], k[b], v[b], torch.ones(160, dtype=torch.bool))
                       ) < 1e-5


def test_the_first_decode_step_frees_the_mirror():
    q, k, v = _qkv(2, 130, (4, 2), seed=6)
    with Store.open(config=_config(1.0)) as store:
        seqs = [store.create(f"s{b}", num_layers=2, num_kv_heads=2, head_dim=8,
                             dtype=torch.float32) for b in range(2)]
        attn = StoreAttention(store, seqs)
        for layer in range(2):
            for a, b in [(0, 70), (70, 129)]:
                attn(layer, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        assert attn.mirror is not None
        held = attn.mirror.held_bytes
        assert held >= 2 * 2 * 129 * 2 * 8 * 4  # two layers of two rows, keys and values
        attn(0, q[:, :, 129:], k[:, :, 129:], v[:, :, 129:])
        assert attn.mirror.held_bytes == 0


def test_the_mirror_is_bounded_by_the_device_by_default_and_off_at_zero():
    with Store.open() as store:
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        assert StoreAttention(store, [seq]).mirror.max_bytes is None
    with Store.open(config=_config(0.0)) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        assert StoreAttention(store, [seq]).mirror is None


def _store_and_seqs(n):
    store = Store.open(config=_config(0.0))
    return store, [store.create(f"s{b}", num_layers=1, num_kv_heads=2, head_dim=8,
                                dtype=torch.float32) for b in range(n)]


def test_entries_grow_by_doubling_within_the_bound_and_drop_when_full():
    token = 2 * 2 * 8 * 4  # keys and values of one token: 2 heads of 8 float32
    k, v = torch.randn(2, 9, 8), torch.randn(2, 9, 8)
    store, (seq,) = _store_and_seqs(1)
    with store:
        mirror = PrefixMirror(8 * token)
        assert mirror.extend(seq, 0, k[:, :5], v[:, :5])[0].shape[1] == 5
        assert mirror.held_bytes == 5 * token
        seq.append(0, k[:, :5], v[:, :5])
        keys, values = mirror.extend(seq, 0, k[:, 5:7], v[:, 5:7])
        assert torch.equal(keys, k[:, :7]) and torch.equal(values, v[:, :7])
        assert mirror.held_bytes == 8 * token  # doubled to 10, cut to the bound's 8
        seq.append(0, k[:, 5:7], v[:, 5:7])
        assert mirror.extend(seq, 0, k[:, 7:9], v[:, 7:9]) is None  # 9 tokens: no room
        assert mirror.held_bytes == 0  # the entry was dropped


def test_a_stale_entry_is_rebuilt_from_what_the_sequence_stores():
    k, v = torch.randn(2, 12, 8), torch.randn(2, 12, 8)
    store, (seq,) = _store_and_seqs(1)
    with store:
        seq.append(0, k[:, :5], v[:, :5])
        mirror = PrefixMirror(1 << 20)
        mirror.extend(seq, 0, k[:, 5:8], v[:, 5:8])  # never stored
        keys, values = mirror.extend(seq, 0, k[:, 8:12], v[:, 8:12])
        assert keys.shape[1] == 9
        assert torch.equal(keys[:, 5:], k[:, 8:12]) and torch.equal(values[:, 5:], v[:, 8:12])
        stored = torch.cat([bk for bk, _ in seq.kv_blocks(0)], dim=1)
        assert torch.equal(keys[:, :5], stored)


def test_prefill_drops_the_entries_of_sequences_left_out_of_its_batch():
    q, k, v = _qkv(2, 20, (4, 2), seed=8)
    store, seqs = _store_and_seqs(2)
    with store:
        mirror = PrefixMirror(1 << 30)
        prefill(store, seqs, 0, q[:, :, :10], k[:, :, :10], v[:, :, :10], scale=0.3,
                mirror=mirror)
        both = mirror.held_bytes
        prefill(store, seqs[:1], 0, q[:1, :, 10:], k[:1, :, 10:], v[:1, :, 10:], scale=0.3,
                mirror=mirror)
        assert mirror.held_bytes == both  # row 0 grew to 20 tokens, row 1's 10 are gone
        mirror.clear()
        assert mirror.held_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_chunks_through_the_mirror_match_the_tier():
    lengths, T, chunk = [600, 451, 90], 600, 128
    q, k, v = _qkv(len(lengths), T, (8, 2), D=64, seed=11)
    valid = _valid(lengths, T)
    cuts = [*range(0, T, chunk), T]
    outs = {}
    for gb in (1.0, 0.0):
        config = {**_config(gb), "executor": {"device": "cuda"}}
        outs[gb], _ = _run(config, *(t.cuda().bfloat16() for t in (q, k, v)),
                           valid.cuda(), cuts)
    assert rel_err(outs[1.0].float().cpu(), outs[0.0].float().cpu()) < 1e-2
    for b in range(len(lengths)):
        want = _reference(*(t.bfloat16().float() for t in (q[b], k[b], v[b])), valid[b])
        assert rel_err(outs[1.0][b].float().cpu(), want) < 2e-2


def test_unbounded_mirror_holds_nothing_on_a_cpu():
    k, v = torch.randn(2, 9, 8), torch.randn(2, 9, 8)
    store, (seq,) = _store_and_seqs(1)
    with store:
        mirror = PrefixMirror(None)
        assert mirror.extend(seq, 0, k, v) is None  # a CPU: rows are read from their tier
        assert mirror.held_bytes == 0


def test_unbounded_mirror_leaves_free_a_share_of_what_the_prompt_started_with(monkeypatch):
    # a CUDA device's memory as the driver and torch's allocator report it, faked: a growth
    # takes what is available above the headroom decided at the prompt's first growth
    import attention.prefix_mirror as pm

    token = 2 * 2 * 8 * 4  # keys and values of one token: 2 heads of 8 float32
    available = [200 * token]
    monkeypatch.setattr(pm, "available_bytes", lambda device: available[0])
    k, v = torch.randn(2, 200, 8), torch.randn(2, 200, 8)
    store, (seq, other) = _store_and_seqs(2)
    with store:
        mirror = PrefixMirror(None)
        mirror.extend(seq, 0, k[:, :40], v[:, :40])  # headroom: 50 of 200 tokens' bytes
        seq.append(0, k[:, :40], v[:, :40])
        available[0] -= 40 * token  # what the entry took
        keys, _ = mirror.extend(seq, 0, k[:, 40:75], v[:, 40:75])
        assert keys.shape[1] == 75 and mirror.held_bytes == 80 * token  # doubled: 80 <= 110
        seq.append(0, k[:, 40:75], v[:, 40:75])
        available[0] = 60 * token  # others took memory since: 60 - 50 is no room for 85
        assert mirror.extend(seq, 0, k[:, 75:85], v[:, 75:85]) is None
        mirror.clear()  # a new prompt decides its headroom again: 10 of 40
        available[0] = 40 * token
        assert mirror.extend(other, 0, k[:, :30], v[:, :30])[0].shape[1] == 30
        mirror.clear()
        assert mirror.extend(other, 0, k[:, :31], v[:, :31]) is None  # 31 > 40 - 10


def test_unbounded_mirror_decides_each_devices_headroom_on_that_device(monkeypatch):
    # layers on two GPUs: each device's headroom is a quarter of what that device had
    import attention.prefix_mirror as pm

    available = {torch.device("cuda", 0): 800, torch.device("cuda", 1): 400}
    monkeypatch.setattr(pm, "available_bytes", lambda device: available[device])
    mirror = PrefixMirror(None)
    assert mirror._room_bytes(torch.device("cuda", 0)) == 600
    assert mirror._room_bytes(torch.device("cuda", 1)) == 300
    available[torch.device("cuda", 0)] = 500  # the mirror took some: the headroom stays
    assert mirror._room_bytes(torch.device("cuda", 0)) == 300


def test_available_bytes_counts_what_torchs_allocator_holds_unused(monkeypatch):
    from attention.prefix_mirror import available_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 5000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 120)
    assert available_bytes(torch.device("cuda", 0)) == 1180
    assert available_bytes(torch.device("cpu")) == 0
