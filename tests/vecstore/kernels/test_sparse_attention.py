"""sparse_decode_attention and sparse_attention_by_clusters against float64 attention."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import (
    DTYPES,
    SHAPES,
    TOLERANCE,
    assert_state_close,
    poisoned,
    ref_attention_rows,
)

from vecstore.errors import ShapeError
from vecstore.kernels import sparse_attention_by_clusters, sparse_decode_attention


def _qkv(batch, num_kv, group, dim, num_rows, dtype, gen):
    q = torch.randn(batch, num_kv * group, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, num_kv, num_rows, dim, generator=gen).to(dtype)
    values = torch.randn(batch, num_kv, num_rows, dim, generator=gen).to(dtype)
    return q, keys, values


def _out(batch, num_q, dim, device):
    return poisoned(
        ((batch, num_q, dim), torch.float32), ((batch, num_q), torch.float32), device=device
    )


def _buffer_case(target, shape, dtype, lengths, gen, num_rows=157):
    batch, num_kv, group, dim = shape
    q, k_buf, v_buf = _qkv(batch, num_kv, group, dim, num_rows, dtype, gen)
    for b in range(batch):
        for h in range(num_kv):
            k_buf[b, h, lengths[b][h] :] = float("nan")  # rows past the length are never read
            v_buf[b, h, lengths[b][h] :] = float("nan")
    out = _out(batch, num_kv * group, dim, target.device)
    dev = [t.to(target.device) for t in (q, k_buf, v_buf, torch.tensor(lengths))]
    result, lse = sparse_decode_attention(*dev, dim**-0.5, backend=target.backend, out=out)
    assert result is out[0] and lse is out[1]
    rows = [[list(range(min(n, num_rows))) for n in row] for row in lengths]
    assert_state_close(
        result, lse, *ref_attention_rows(q, k_buf, v_buf, rows, dim**-0.5), TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_buffer_matches_reference(target, gen, shape, dtype):
    batch, num_kv = shape[0], shape[1]
    odd = [131, 157, 1, 77]  # odd lengths: full, partial blocks, a single row
    lengths = [[odd[(b * num_kv + h) % 4] for h in range(num_kv)] for b in range(batch)]
    _buffer_case(target, shape, dtype, lengths, gen)


def test_buffer_empty_rows(target, gen):
    # Length 0 gives an empty state; 200 is past M and is clamped to M.
    _buffer_case(target, (2, 2, 3, 64), torch.bfloat16, [[0, 200], [65, 0]], gen, num_rows=130)


def test_buffer_one_split(target, gen):
    # M within one block: the kernel writes the final state directly, without a combine.
    _buffer_case(target, (1, 2, 4, 64), torch.float16, [[50, 17]], gen, num_rows=50)


def _clusters(batch, num_kv, num_rows, num_picked, gen):
    """Cut each head's rows into clusters; pick some, pad with empty ranges."""
    starts = torch.zeros(batch, num_kv, num_picked + 2, dtype=torch.int32)
    lengths = torch.zeros_like(starts)
    picked_rows = []
    for b in range(batch):
        picked_rows.append([])
        for h in range(num_kv):
            cuts = torch.randperm(num_rows - 1, generator=gen)[: num_picked * 3] + 1
            bounds = [0, *sorted(cuts.tolist()), num_rows]
            spans = [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
            chosen = [spans[c] for c in torch.randperm(len(spans), generator=gen)[:num_picked]]
            for slot, (lo, count) in enumerate(chosen):
                starts[b, h, slot], lengths[b, h, slot] = lo, count
            starts[b, h, -2:] = torch.tensor([num_rows + 5, 3])  # padding: length 0
            picked_rows[-1].append([r for lo, count in chosen for r in range(lo, lo + count)])
    return starts, lengths, picked_rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_by_clusters_matches_reference(target, gen, shape, dtype):
    batch, num_kv, group, dim = shape
    q, keys, values = _qkv(batch, num_kv, group, dim, 211, dtype, gen)
    starts, lengths, rows = _clusters(batch, num_kv, 211, 9, gen)
    chosen = torch.zeros(batch, num_kv, 211, dtype=torch.bool)
    for b in range(batch):
        for h in range(num_kv):
            chosen[b, h, rows[b][h]] = True
    keys[~chosen] = float("nan")  # clusters not retrieved are never read
    values[~chosen] = float("nan")
    out = _out(batch, num_kv * group, dim, target.device)
    dev = [t.to(target.device) for t in (q, keys, values, starts, lengths)]
    result, lse = sparse_attention_by_clusters(*dev, dim**-0.5, backend=target.backend, out=out)
    assert result is out[0] and lse is out[1]
    ref = ref_attention_rows(q, keys, values, rows, dim**-0.5)
    assert_state_close(result, lse, *ref, TOLERANCE[dtype])


def test_by_clusters_empty_and_clipped(target, gen):
    q, keys, values = _qkv(1, 2, 4, 64, 100, torch.float32, gen)
    starts = torch.tensor([[[90, -5, 40], [0, 0, 0]]])
    lengths = torch.tensor([[[30, 10, 0], [0, 0, 0]]])  # clipped to [0, 100); head 1 empty
    dev = [t.to(target.device) for t in (q, keys, values, starts, lengths)]
    result, lse = sparse_attention_by_clusters(*dev, 0.125, backend=target.backend)
    rows = [[[*range(90, 100), *range(0, 5)], []]]
    assert_state_close(
        result, lse, *ref_attention_rows(q, keys, values, rows, 0.125), TOLERANCE[torch.float32]
    )


def test_rejects_bad_shapes():
    q = torch.randn(1, 4, 8)
    kv = torch.randn(1, 2, 10, 8)
    with pytest.raises(ShapeError):
        sparse_decode_attention(q, kv, kv.half(), torch.ones(1, 2, dtype=torch.int32), 0.5)
    with pytest.raises(ShapeError):
        sparse_decode_attention(q, kv, kv, torch.ones(2, 1, dtype=torch.int32), 0.5)
    with pytest.raises(ShapeError):
        sparse_attention_by_clusters(
            q, kv, kv, torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 4), 0.5
        )
