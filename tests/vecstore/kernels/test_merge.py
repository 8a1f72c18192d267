"""merge_states: two disjoint attention states merge into the state over their union."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_refs import assert_state_close, ref_attention_rows

from vecstore.errors import ShapeError
from vecstore.kernels import merge_states


@given(
    split=st.integers(min_value=0, max_value=23),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_merge_equals_attention_over_union(split, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 16, generator=gen)
    keys = 3.0 * torch.randn(2, 2, 23, 16, generator=gen)
    values = torch.randn(2, 2, 23, 16, generator=gen)
    left = [[list(range(split))] * 2] * 2
    right = [[list(range(split, 23))] * 2] * 2
    out_a, lse_a = ref_attention_rows(q, keys, values, left, 0.25)
    out_b, lse_b = ref_attention_rows(q, keys, values, right, 0.25)
    out, lse = merge_states(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    whole = ref_attention_rows(q, keys, values, [[list(range(23))] * 2] * 2, 0.25)
    assert_state_close(out, lse, *whole, 1e-5)


def test_both_empty_gives_empty_state():
    out = torch.randn(3, 5)
    empty = torch.full((3,), float("-inf"))
    merged, lse = merge_states(out, empty, 2 * out, empty.clone())
    assert torch.isneginf(lse).all() and torch.all(merged == 0)


def test_one_empty_is_identity():
    out, lse = torch.randn(3, 5), torch.randn(3)
    merged, merged_lse = merge_states(
        out.bfloat16(), lse, torch.zeros(3, 5), torch.full((3,), float("-inf"))
    )
    assert merged.dtype == torch.float32 and torch.equal(merged_lse, lse)
    torch.testing.assert_close(merged, out.bfloat16().float())


def test_rejects_mismatched_shapes():
    with pytest.raises(ShapeError):
        merge_states(torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, 3), torch.zeros(2))
