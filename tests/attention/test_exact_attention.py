"""attention.exact: SDPA-equivalent causal attention, over the step alone or a stored prefix."""

from __future__ import annotations

import pytest
import torch

from attention import causal_mask, group_size, repeat_kv, sdpa, sdpa_lower_right
from tests.reference import rel_err
from vecstore.errors import ShapeError


def _reference(q, k, v, scale, valid=None):
    """Causal attention in float64 with a key validity mask; the last ``Lq`` of the
    ``S`` keys are the queries' own tokens (lower-right aligned)."""
    B, Hq, L, D = q.shape
    S = k.shape[2]
    g = Hq // k.shape[1]
    kd = k.double().repeat_interleave(g, 1)
    vd = v.double().repeat_interleave(g, 1)
    logits = scale * q.double() @ kd.transpose(2, 3)
    allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.exp(logits - lse[..., None]).nan_to_num(0.0) @ vd


def _qkv(B, Hq, Hkv, L, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, D, generator=gen), torch.randn(B, Hkv, L, D, generator=gen),
            torch.randn(B, Hkv, L, D, generator=gen))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
@pytest.mark.parametrize("L", [1, 7, 33])
def test_sdpa_matches_float64_reference(heads, L):
    q, k, v = _qkv(2, *heads, L, 16)
    assert rel_err(sdpa(q, k, v, scale=0.25), _reference(q, k, v, 0.25)) < 1e-5


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(("L", "S"), [(1, 1), (5, 5), (7, 40), (1, 33)])
def test_lower_right_attends_the_prefix_and_causally_itself(heads, L, S):
    q, _, _ = _qkv(1, heads[0], heads[1], L, 16, seed=L)
    _, k, v = _qkv(1, heads[0], heads[1], S, 16, seed=S)
    out = sdpa_lower_right(q[0], k[0], v[0], scale=0.25)
    assert rel_err(out, _reference(q, k, v, 0.25)[0]) < 1e-5


def test_left_padding_is_never_attended_and_pad_queries_get_zeros():
    q, k, v = _qkv(3, 4, 2, 10, 8)
    valid = torch.ones(3, 10, dtype=torch.bool)
    valid[1, :4] = False
    valid[2, :9] = False
    ref = _reference(q, k, v, 0.3, valid)
    fast = sdpa(q, k, v, scale=0.3, valid=valid)
    assert rel_err(fast, ref) < 1e-5
    assert torch.equal(fast[2, :, :9], torch.zeros_like(fast[2, :, :9]))
    # a padded key changes nothing for the valid queries
    k2 = k.clone()
    k2[1, :, :4] = 1e3
    assert torch.allclose(sdpa(q, k2, v, scale=0.3, valid=valid)[1, :, 4:], fast[1, :, 4:])


def test_lower_right_query_slices_give_the_same_result(monkeypatch):
    q, _, _ = _qkv(1, 4, 2, 50, 8)
    _, k, v = _qkv(1, 4, 2, 80, 8, seed=1)
    whole = sdpa_lower_right(q[0], k[0], v[0], scale=0.3)
    monkeypatch.setattr("vecstore.slicing.SCORE_BUDGET", 4 * 80 * 3)  # 3 queries a slice
    sliced = sdpa_lower_right(q[0], k[0], v[0], scale=0.3)
    assert torch.allclose(whole, sliced, atol=1e-6)
    assert rel_err(sliced, _reference(q, k, v, 0.3)[0]) < 1e-5


def test_output_keeps_the_query_dtype():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(1, 4, 2, 9, 8))
    assert sdpa(q, k, v, scale=0.3).dtype == torch.bfloat16
    assert sdpa_lower_right(q[0, :, 3:], k[0], v[0], scale=0.3).dtype == torch.bfloat16


def test_causal_mask_and_gqa_helpers():
    mask = causal_mask(None, 3, torch.device("cpu"))
    assert mask.shape == (1, 1, 3, 3) and torch.equal(mask[0, 0], torch.ones(3, 3).tril().bool())
    x = torch.arange(6.0).reshape(1, 3, 2, 1)
    assert repeat_kv(x, 2)[0, :, 0, 0].tolist() == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0]
    assert repeat_kv(x, 1) is x
    assert group_size(12, 4) == 3
    with pytest.raises(ShapeError, match="multiple of the 4 KV heads"):
        group_size(6, 4)
