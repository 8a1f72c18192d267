"""Radix-select helpers shared by the score and selection kernels (Triton device functions).

Scores map to uint32 keys in the same order; the ``k``-th largest key of a row is found MSB
first, ``RADIX_BITS`` bits a pass, from per-pass histograms of the keys that match the
prefix chosen by the passes before (``counts[row, which, pass, digit]``, which 0 for ``k1``
and 1 for ``k2``). A histogram is a warp-ballot count, far lighter in registers than
comparing every key with every candidate digit. Pass 0 is counted by all chunks of a row at
once, with atomics (``radix_count``). For rows short enough the later passes run in one
launch of a program per row and threshold that sums each pass's histogram in registers
(``radix_histogram``) and chooses its digit right away (``radix_digit``); longer rows count a
few more passes the first way, then run the rest the second way over the scores that still
match each threshold's prefix (:mod:`vecstore.executor.wave_select`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "RADIX_BITS", "RADIX_PASSES", "radix_keys", "radix_digit", "radix_threshold",
    "radix_histogram", "radix_count",
]

RADIX_BITS = 5  # histogram bins 2**5: the warp-ballot histogram needs a multiple of 32
RADIX_PASSES = triton.cdiv(32, RADIX_BITS)


@triton.jit
def radix_keys(score):
    # float32 -> uint32 keys in the same order (higher score, higher key)
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)


@triton.jit
def radix_digit(h, above, k, PASS: tl.constexpr, BITS: tl.constexpr):
    # pass PASS's digit of the k-th largest key (shifted into place), from the histogram
    # h [1, 2**BITS] of the keys matching the prefix so far, and the keys ranking above the
    # extended prefix; above [1] counts those above the prefix so far
    bins = tl.arange(0, 1 << BITS)
    hi = 32 - BITS * PASS  # pass PASS resolves key bits [lo, hi); the last may be narrower
    lo = hi - BITS if hi > BITS else 0
    suf = tl.sum(h, axis=1)[:, None] - tl.cumsum(h, axis=1) + h
    d = tl.sum(((above[:, None] + suf >= k) & (bins[None, :] > 0)).to(tl.int32), axis=1)
    d = tl.minimum(d, (1 << (hi - lo)) - 1)
    above += tl.sum(tl.where(bins[None, :] > d[:, None], h, 0), axis=1)
    return d.to(tl.uint32) << lo, above


@triton.jit
def radix_threshold(hist_ptr, k, PASSES: tl.constexpr, BITS: tl.constexpr):
    # the k-th largest key after PASSES passes (exact once all have run), from the
    # histograms hist[p, digit] of the keys matching the prefix of the passes before; and
    # how many keys rank above that prefix
    bins = tl.arange(0, 1 << BITS)
    t = tl.zeros([1], tl.uint32)
    above = tl.zeros([1], tl.int32)
    for p in tl.static_range(PASSES):
        h = tl.load(hist_ptr + p * (1 << BITS) + bins)[None, :]
        d, above = radix_digit(h, above, k, p, BITS)
        t = t | d
    return tl.sum(t, axis=0), tl.sum(above, axis=0)


@triton.jit
def _digit_of(key, valid, t, PASS: tl.constexpr, BITS: tl.constexpr):
    # pass PASS's digit of each key, and which keys take part: valid ones matching prefix t
    hi = 32 - BITS * PASS
    lo = hi - BITS if hi > BITS else 0
    digit = ((key >> lo) & ((1 << (hi - lo)) - 1)).to(tl.int32)
    match = valid
    if PASS > 0:
        match = valid & ((key >> hi) == (t >> hi))
    return digit, match


@triton.jit
def radix_histogram(score_ptr, C, t, PASS: tl.constexpr, BITS: tl.constexpr,
                    BLOCK: tl.constexpr):
    # the histogram [2**BITS] of pass PASS's digit over the keys of scores [C] that match
    # prefix t, summed in registers over the row
    h = tl.zeros([1 << BITS], tl.int32)
    for c0 in range(0, C, BLOCK):
        idx = c0 + tl.arange(0, BLOCK)
        valid = idx < C
        key = radix_keys(tl.load(score_ptr + idx, mask=valid, other=0.0))
        digit, match = _digit_of(key, valid, t, PASS, BITS)
        h += tl.histogram(digit, 1 << BITS, mask=match)
    return h


@triton.jit
def radix_count(key, valid, t, counts_ptr, PASS: tl.constexpr, BITS: tl.constexpr):
    # add the histogram of pass PASS's digit over the keys that match prefix t
    digit, match = _digit_of(key, valid, t, PASS, BITS)
    h = tl.histogram(digit, 1 << BITS, mask=match)
    bins = tl.arange(0, 1 << BITS)
    tl.atomic_add(counts_ptr + PASS * (1 << BITS) + bins, h, mask=h > 0)
