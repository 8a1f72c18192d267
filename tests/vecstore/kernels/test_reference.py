"""The torch reference (attend, estimate, merge) against the float64 loops of the definitions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_refs import (
    assert_state_close,
    ref_attention_rows,
    ref_centroid_scores,
    ref_estimate,
)

from vecstore.index.pages import group_softmax_rank
from vecstore.index.wave import bound_logits
from vecstore.kernels.reference import attend, estimate, merge

B, HKV, G, D = 2, 2, 3, 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attend_equals_attention_over_the_valid_rows(gen, dtype):
    q = torch.randn(B, HKV, G, 2, D, generator=gen, dtype=dtype)
    keys = 2 * torch.randn(B, HKV, 40, D, generator=gen, dtype=dtype)
    values = torch.randn(B, HKV, 40, D, generator=gen, dtype=dtype)
    valid = torch.rand(B, HKV, 40, generator=gen) < 0.6
    valid[1, 0] = False  # a KV head with no valid row: an empty state
    keys[~valid] = float("nan")  # invalid rows get no weight, whatever their keys hold
    out, lse = attend(q, keys, values, valid, 0.25)
    assert out.dtype == lse.dtype == dtype
    rows = [[valid[b, h].nonzero().flatten().tolist() for h in range(HKV)] for b in range(B)]
    for t in range(2):
        ref = ref_attention_rows(q[:, :, :, t].reshape(B, HKV * G, D), keys, values, rows, 0.25)
        got_out, got_lse = out[:, :, :, t].reshape(B, HKV * G, D), lse[:, :, :, t].reshape(B, -1)
        assert_state_close(got_out, got_lse, *ref, 1e-6)


def test_attend_with_a_mask_per_query_is_causal(gen):
    q = torch.randn(1, 1, G, 4, D, generator=gen, dtype=torch.float64)
    keys = torch.randn(1, 1, 6, D, generator=gen, dtype=torch.float64)
    values = torch.randn(1, 1, 6, D, generator=gen, dtype=torch.float64)
    pos = torch.arange(6)
    mask = pos[None, :] <= pos[2:, None]  # [L, T]: query t sees keys 0..t + 2
    out, lse = attend(q, keys, values, mask[None, None, None], 0.5)
    for t in range(4):
        ref = ref_attention_rows(q[:, :, :, t].reshape(1, G, D), keys, values,
                                 [[list(range(t + 3))]], 0.5)
        assert_state_close(out[:, :, :, t].reshape(1, G, D),
                           lse[:, :, :, t].reshape(1, G), *ref, 1e-9)


def test_estimate_equals_the_estimation_definition(gen):
    C, E = 30, 12
    q = torch.randn(B, HKV, G, 1, D, generator=gen, dtype=torch.float64)
    centroids = torch.randn(B, HKV, C, D, generator=gen, dtype=torch.float64)
    sizes = torch.randint(0, 9, (B, HKV, C), generator=gen)
    value_sums = sizes[..., None] * torch.randn(B, HKV, C, D, generator=gen, dtype=torch.float64)
    ids = torch.argsort(torch.rand(B, HKV, C, generator=gen), -1)[..., :E]
    ids[0, 1, ::3] = -1  # padding
    safe = ids.clamp_min(0)
    n = (sizes.gather(-1, safe) * (ids >= 0)).double()  # [B, Hkv, E]; 0 excludes
    gather = safe[..., None].expand(-1, -1, -1, D)
    out, lse = estimate(q, centroids.gather(2, gather), n.log(),
                        value_sums.gather(2, gather) / n.clamp_min(1)[..., None], 0.3)
    logits = 0.3 * torch.einsum("bhgd,bhcd->bhgc", q[:, :, :, 0], centroids)
    ref = ref_estimate(logits.reshape(B, HKV * G, C), sizes, value_sums, ids)
    assert_state_close(out.reshape(B, HKV * G, D), lse.reshape(B, -1), *ref,
                       1e-9)


def test_index_ranking_is_the_group_softmax_of_centroid_logits(gen):
    # the score the kernels rank by has its torch reference in the index (radius weight 0)
    C = 25
    q = torch.randn(B, HKV * G, D, generator=gen, dtype=torch.float64)
    centroids = torch.randn(B, HKV, C, D, generator=gen, dtype=torch.float64)
    sizes = torch.randint(0, 4, (B, HKV, C), generator=gen)
    logits = bound_logits(q.view(B, HKV, G, 1, D), centroids, torch.zeros(B, HKV, C), 0.3, 0.0)
    score = group_softmax_rank(logits, sizes)
    ref_logits, ref_score = ref_centroid_scores(q, centroids, sizes, 0.3)
    live = sizes > 0
    assert torch.allclose(score[live], ref_score[live], atol=1e-12)
    assert torch.isneginf(score[~live]).all()
    assert torch.allclose(logits.reshape(B, HKV * G, C)[ref_logits.isfinite()],
                          ref_logits[ref_logits.isfinite()])


@given(split=st.integers(min_value=0, max_value=23),
       seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_merge_equals_attention_over_union(split, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 16, generator=gen)
    keys = 3.0 * torch.randn(2, 2, 23, 16, generator=gen)
    values = torch.randn(2, 2, 23, 16, generator=gen)
    left = [[list(range(split))] * 2] * 2
    right = [[list(range(split, 23))] * 2] * 2
    out_a, lse_a = ref_attention_rows(q, keys, values, left, 0.25)
    out_b, lse_b = ref_attention_rows(q, keys, values, right, 0.25)
    out, lse = merge(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    whole = ref_attention_rows(q, keys, values, [[list(range(23))] * 2] * 2, 0.25)
    assert_state_close(out, lse, *whole, 1e-5)


def test_merge_of_two_empty_states_is_empty():
    out = torch.randn(3, 5)
    empty = torch.full((3,), float("-inf"))
    merged, lse = merge(out, empty, 2 * out, empty.clone())
    assert torch.isneginf(lse).all() and torch.all(merged == 0)


def test_merge_with_an_empty_state_is_the_identity():
    out, lse = torch.randn(3, 5), torch.randn(3)
    merged, merged_lse = merge(out, lse, torch.zeros(3, 5), torch.full((3,), float("-inf")))
    assert torch.equal(merged_lse, lse)
    torch.testing.assert_close(merged, out)
