"""attention.exact: SDPA-equivalent causal attention, with and without log-sum-exp."""

from __future__ import annotations

import pytest
import torch

import attention.exact as exact
from attention import attention_with_lse, causal_mask, group_size, repeat_kv, sdpa
from tests.reference import rel_err
from vecstore.errors import ShapeError


def _reference(q, k, v, scale, valid=None):
    """Causal attention in float64 with a key validity mask; returns out, lse."""
    B, Hq, L, D = q.shape
    g = Hq // k.shape[1]
    kd = k.double().repeat_interleave(g, 1)
    vd = v.double().repeat_interleave(g, 1)
    logits = scale * q.double() @ kd.transpose(2, 3)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    return probs @ vd, lse


def _qkv(B, Hq, Hkv, L, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, D, generator=gen), torch.randn(B, Hkv, L, D, generator=gen),
            torch.randn(B, Hkv, L, D, generator=gen))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
@pytest.mark.parametrize("L", [1, 7, 33])
def test_both_forms_match_float64_reference(heads, L):
    q, k, v = _qkv(2, *heads, L, 16)
    ref, ref_lse = _reference(q, k, v, 0.25)
    out, lse = attention_with_lse(q, k, v, scale=0.25)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-5
    assert rel_err(sdpa(q, k, v, scale=0.25), ref) < 1e-5


def test_left_padding_is_never_attended_and_pad_queries_get_zeros():
    q, k, v = _qkv(3, 4, 2, 10, 8)
    valid = torch.ones(3, 10, dtype=torch.bool)
    valid[1, :4] = False
    valid[2, :9] = False
    ref, ref_lse = _reference(q, k, v, 0.3, valid)
    out, lse = attention_with_lse(q, k, v, scale=0.3, valid=valid)
    fast = sdpa(q, k, v, scale=0.3, valid=valid)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(fast, ref) < 1e-5
    assert torch.equal(out[1, :, :4], torch.zeros_like(out[1, :, :4]))
    assert torch.equal(fast[2, :, :9], torch.zeros_like(fast[2, :, :9]))
    assert bool(torch.isneginf(lse[1, :, :4]).all())
    assert torch.isfinite(lse[valid[:, None, :].expand_as(lse)]).all()
    # a padded key changes nothing for the valid queries
    k2 = k.clone()
    k2[1, :, :4] = 1e3
    assert torch.allclose(attention_with_lse(q, k2, v, scale=0.3, valid=valid)[0], out)


def test_chunked_scores_give_the_same_result(monkeypatch):
    q, k, v = _qkv(1, 4, 2, 50, 8)
    whole = attention_with_lse(q, k, v, scale=0.3)
    monkeypatch.setattr(exact, "_SCORE_BUDGET", 4 * 50 * 3)  # three queries per chunk
    chunked = attention_with_lse(q, k, v, scale=0.3)
    assert torch.allclose(whole[0], chunked[0]) and torch.allclose(whole[1], chunked[1])


def test_output_keeps_the_query_dtype():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(1, 4, 2, 9, 8))
    out, lse = attention_with_lse(q, k, v, scale=0.3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert sdpa(q, k, v, scale=0.3).dtype == torch.bfloat16


def test_causal_mask_and_gqa_helpers():
    mask = causal_mask(None, 3, torch.device("cpu"))
    assert mask.shape == (1, 1, 3, 3) and torch.equal(mask[0, 0], torch.ones(3, 3).tril().bool())
    x = torch.arange(6.0).reshape(1, 3, 2, 1)
    assert repeat_kv(x, 2)[0, :, 0, 0].tolist() == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0]
    assert repeat_kv(x, 1) is x
    assert group_size(12, 4) == 3
    with pytest.raises(ShapeError, match="multiple of the 4 KV heads"):
        group_size(6, 4)
