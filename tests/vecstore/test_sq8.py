"""SQ8 centroid codes: within half a step of the input, the extremes exact, zeros kept."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from vecstore.executor.sq8 import dequantize, quantize

_FLOATS = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(arrays("float32", st.tuples(st.integers(1, 5), st.integers(1, 40)), elements=_FLOATS))
def test_codes_round_to_the_nearest_step(x):
    x = torch.from_numpy(x)
    codes, scale = quantize(x)
    assert codes.dtype == torch.int8 and scale.shape == x.shape[:-1]
    assert int(codes.abs().max()) <= 127
    err = (dequantize(codes, scale) - x).abs()
    assert bool((err <= scale[:, None] * 0.5 * (1 + 1e-5) + 1e-30).all())
    # each vector's largest magnitude becomes +-127, so the scale is max |x| / 127
    peak = x.abs().argmax(dim=1)
    top = codes.gather(1, peak[:, None])[:, 0].int().abs()
    assert bool(((top == 127) | (scale == 0)).all())


def test_zero_vectors_get_zero_codes_and_scale():
    codes, scale = quantize(torch.zeros(3, 8))
    assert not codes.any() and not scale.any()
    assert not dequantize(codes, scale).isnan().any()


def test_bfloat16_input_is_quantized_like_its_float32_value():
    x = torch.randn(4, 64).bfloat16()
    got, want = quantize(x), quantize(x.float())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
