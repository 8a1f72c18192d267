"""attention.varlen and attention.prefix: rows of different lengths attended in one call
give each row's own attention; rows are packed in the fewest groups that fit the bound,
split evenly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.prefix import groups_on_device
from attention.varlen import flash_applies, varlen_attention
from tests.attention.test_exact_attention import _reference
from tests.reference import rel_err

CPU = torch.device("cpu")


def _packed(lengths, news, heads, D=16, dtype=torch.float32, device="cpu", seed=0):
    """Random rows packed: row b has ``lengths[b]`` keys, its last ``news[b]`` being its
    queries' own tokens; returns q, k, v and the offsets."""
    gen = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    q = torch.randn(sum(news), Hq, D, generator=gen)
    k, v = (torch.randn(sum(lengths), Hkv, D, generator=gen) for _ in range(2))
    cu_q, cu_k = [0], [0]
    for n, s in zip(news, lengths, strict=True):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + s)
    return (*(t.to(device, dtype) for t in (q, k, v)), cu_q, cu_k)


def _row_reference(q, k, v, cu_q, cu_k, b, scale):
    rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
    one = (t.transpose(0, 1)[None] for t in (q[rq], k[rk], v[rk]))
    return _reference(*one, scale)[0].transpose(0, 1)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])
def test_each_row_of_a_packed_call_is_its_own_lower_right_causal_attention(heads):
    lengths, news = [37, 5, 90, 12], [7, 5, 1, 12]
    q, k, v, cu_q, cu_k = _packed(lengths, news, heads, seed=heads[1])
    out = varlen_attention(q, k, v, cu_q=cu_q, cu_k=cu_k, scale=0.25)
    for b in range(len(lengths)):
        want = _row_reference(q, k, v, cu_q, cu_k, b, 0.25)
        assert rel_err(out[cu_q[b]:cu_q[b + 1]], want) < 1e-5


def test_a_soft_cap_applies_to_every_row():
    q, k, v, cu_q, cu_k = _packed([20, 9], [4, 9], (4, 2), seed=3)
    capped = varlen_attention(q * 20, k, v, cu_q=cu_q, cu_k=cu_k, scale=0.25, softcap=2.0)
    for b in range(2):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        logits = (q[rq] * 20).transpose(0, 1) @ k[rk].repeat_interleave(2, 1).permute(1, 2, 0)
        logits = 2.0 * torch.tanh(logits * 0.25 / 2.0)
        n, S = rq.stop - rq.start, rk.stop - rk.start
        logits = logits.masked_fill(~torch.ones(n, S, dtype=torch.bool).tril(S - n), -torch.inf)
        want = torch.softmax(logits, -1) @ v[rk].repeat_interleave(2, 1).transpose(0, 1)
        assert rel_err(capped[rq], want.transpose(0, 1)) < 1e-5


def test_flash_applies_only_where_it_can_run():
    half = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    assert not flash_applies(half, half)  # on the CPU
    if torch.cuda.is_available():
        cuda = half.cuda()
        assert flash_applies(cuda, cuda)
        assert not flash_applies(cuda, cuda, softcap=30.0)
        assert not flash_applies(cuda.float(), cuda.float())
        assert not flash_applies(cuda[..., :60], cuda[..., :60])


def _rows(lengths, Hkv=2, D=4, split=2):
    """Rows of ``lengths`` tokens, each in two blocks (indexed rows, then new tokens),
    with values numbering the tokens: row b's token t holds ``1000 * b + t``."""
    rows = []
    for b, n in enumerate(lengths):
        tokens = (1000 * b + torch.arange(n, dtype=torch.float32))[None, :, None]
        full = tokens.expand(Hkv, n, D)
        cut = min(split, n)
        rows.append([(full[:, :cut], -full[:, :cut]), (full[:, cut:], -full[:, cut:])])
    return rows


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
       max_tokens=st.integers(1, 120))
def test_groups_pack_every_row_once_in_the_fewest_groups_within_the_bound(lengths,
                                                                         max_tokens):
    rows = [[b for b in r if b[0].shape[1]] for r in _rows(lengths)]
    per_token = 2 * 2 * 4 * 4  # keys and values, 2 heads x 4 dims of float32
    groups = list(groups_on_device(rows, CPU, max_bytes=max_tokens * per_token))
    assert [r for g in groups for r in g.rows] == list(range(len(lengths)))
    fewest, held = 1, 0
    for n in lengths:  # filling each group before the next: the fewest groups
        if held and held + n > max_tokens:
            fewest, held = fewest + 1, 0
        held += n
    assert len(groups) == fewest
    for g in groups:
        assert len(g.rows) == 1 or g.offsets[-1] <= max_tokens
        for i, r in enumerate(g.rows):
            span = slice(g.offsets[i], g.offsets[i + 1])
            want = 1000 * r + torch.arange(lengths[r], dtype=torch.float32)
            assert torch.equal(g.keys[0, span, 0], want)
            assert torch.equal(g.values[1, span, 3], -want)
    if len(set(lengths)) == 1:  # equal rows: as many in every group, give or take one
        sizes = [len(g.rows) for g in groups]
        assert max(sizes) - min(sizes) <= 1


def test_a_lone_row_on_the_device_is_not_copied():
    k = torch.randn(2, 5, 4)
    (group,) = groups_on_device([[(k, k)]], CPU, max_bytes=1 << 20)
    assert group.keys is k and group.offsets == [0, 5]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
def test_flash_equals_each_rows_reference_on_cuda(heads):
    lengths, news = [3000, 700, 682, 1], [682, 700, 682, 1]
    q, k, v, cu_q, cu_k = _packed(lengths, news, heads, D=128, dtype=torch.bfloat16,
                                  device="cuda")
    assert flash_applies(q, k)
    out = varlen_attention(q, k, v, cu_q=cu_q, cu_k=cu_k, scale=128 ** -0.5)
    host = [t.cpu().float() for t in (q, k, v)]
    for b in range(len(lengths)):
        want = _row_reference(*host, cu_q, cu_k, b, 128 ** -0.5)
        assert rel_err(out[cu_q[b]:cu_q[b + 1]].cpu().double(), want) < 2e-2
    # head-major packing, as groups_on_device lays rows out: keys seen token-major
    kh, vh = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    strided = varlen_attention(q, kh.transpose(0, 1), vh.transpose(0, 1), cu_q=cu_q,
                               cu_k=cu_k, scale=128 ** -0.5)
    assert torch.equal(strided, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_from_host_memory_go_one_a_group_device_rows_together():
    host = [[(torch.ones(2, 5, 8).pin_memory(), torch.ones(2, 5, 8).pin_memory())]] * 3
    device = [[(torch.ones(2, 5, 8, device="cuda"), torch.ones(2, 5, 8, device="cuda"))]] * 3
    cuda = torch.device("cuda")
    alone = [range(i, i + 1) for i in range(3)]
    assert [g.rows for g in groups_on_device(host, cuda, max_bytes=1 << 20)] == alone
    groups = list(groups_on_device(device, cuda, max_bytes=1 << 20))
    assert [g.rows for g in groups] == [range(0, 3)]
    assert float(groups[0].keys.sum()) == 2 * 15 * 8
