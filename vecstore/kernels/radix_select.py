"""The radix select of the index probe: device helpers shared with the score and zone
kernels, and the passes that find each row's two thresholds (:func:`radix_thresholds`).

Scores map to uint32 keys in the same order; the ``k``-th largest key of a row is found MSB
first, ``RADIX_BITS`` bits a pass, from per-pass histograms of the keys that match the
prefix chosen by the passes before (``counts[row, which, pass, digit]``, which 0 for ``k1``
and 1 for ``k2``). A histogram is a warp-ballot count, far lighter in registers than
comparing every key with every candidate digit. Pass 0 is counted by all chunks of a row at
once, with atomics (``radix_count``). For rows short enough the later passes run in one
launch of a program per row and threshold that sums each pass's histogram in registers
(``radix_histogram``) and chooses its digit right away (``radix_digit``); longer rows count a
few more passes the first way, then run the rest the second way over the scores that still
match each threshold's prefix (candidate lists, ``_radix_compact_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels.backend import LazyKernel

__all__ = [
    "RADIX_BITS", "RADIX_PASSES", "radix_keys", "radix_digit", "radix_threshold",
    "radix_histogram", "radix_count", "radix_thresholds", "chained", "follow",
]

RADIX_BITS = 5  # histogram bins 2**5: the warp-ballot histogram needs a multiple of 32
RADIX_PASSES = triton.cdiv(32, RADIX_BITS)
# Rows of at most _ROW_RADIX_MAX clusters run the radix passes after the first in one
# launch, a program per row and threshold (H200: 18 us against 25 us for a launch per pass
# at 8 x 8192 clusters). Longer rows run passes 1.._KEPT - 1 as launches over all (row,
# chunk) programs, then copy each threshold's candidates (the scores still matching its
# 15-bit prefix) into a list of at most 1/_CAND_FRACTION of the row, and a program
# per row and threshold runs the remaining passes over that list. H200 whole steps against
# a launch per pass (rows of one program up to 32768): 0.448 against 0.460 ms at 8 x 512K,
# 0.441 against 0.465 at 4 x 1M, 0.873 against 0.921 at 8 x 1M (_KEPT 2 or 4 slower)
_ROW_RADIX_MAX = 8192
_KEPT = triton.cdiv(15, RADIX_BITS)  # passes before the candidate lists: a 15-bit prefix or more
_CAND_FRACTION = 8
# a row program copies the scores still matching its threshold's prefix before this pass
# into a list of its own (at most 1/_CAND_FRACTION of the row) and runs the later passes
# over the list (0: every pass over the whole row), walking lists _LIST_BLOCK scores a step.
# H200 captured steps at 1 / 4 / 8 / 24 x 128K (variants/radix_lists.md, one process):
# 0.0651 / 0.0990 / 0.139 / 0.343 ms from pass 3 with blocks of 1024, 0.0636 / 0.0991 /
# 0.138 / 0.342 with 512, against 0.0663 / 0.1006 / 0.1415 / 0.346 over the whole row
# in blocks of 4096; from pass 2 or 1 slower than the whole row (0.147 at 8 x 128K: the
# 10-bit prefix overflows the lists), from pass 4 0.141; 4 x 512K and 4 x 1M (candidate
# lists in blocks of 512) within 1 %
_ROW_COMPACT_AT = 3
_LIST_BLOCK = 512
_RADIX_BLOCK = 4096  # scores per step of a row program's walk
_RADIX_WARPS = 16


@triton.jit
def follow(GDC: tl.constexpr):
    # with GDC (programmatic dependent launch, chained): wait for the kernel before on the
    # stream, then let the next one be scheduled while this one runs
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
    # histograms hist[p, digit] of the keys matching the prefix of the passes before
    bins = tl.arange(0, 1 << BITS)
    t = tl.zeros([1], tl.uint32)
    above = tl.zeros([1], tl.int32)
    for p in tl.static_range(PASSES):
        h = tl.load(hist_ptr + p * (1 << BITS) + bins)[None, :]
        d, above = radix_digit(h, above, k, p, BITS)
        t = t | d
    return tl.sum(t, axis=0)


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
def radix_count(key, valid, t1, t2, hist1_ptr, hist2_ptr, PASS: tl.constexpr,
                BITS: tl.constexpr):
    # add the histograms of pass PASS's digit over the keys that match prefix t1, and t2, to
    # the two thresholds' counts; one histogram serves both where the prefixes are the same
    # (always in pass 0, mostly in pass 1: a 5-bit first digit rarely splits them)
    digit, match1 = _digit_of(key, valid, t1, PASS, BITS)
    h1 = tl.histogram(digit, 1 << BITS, mask=match1)
    bins = tl.arange(0, 1 << BITS)
    tl.atomic_add(hist1_ptr + PASS * (1 << BITS) + bins, h1, mask=h1 > 0)
    if PASS == 0:
        h2 = h1
    else:
        HI: tl.constexpr = 32 - BITS * PASS
        if (t1 >> HI) == (t2 >> HI):
            h2 = h1
        else:
            h2 = tl.histogram(digit, 1 << BITS, mask=_digit_of(key, valid, t2, PASS, BITS)[1])
    tl.atomic_add(hist2_ptr + PASS * (1 << BITS) + bins, h2, mask=h2 > 0)


def _radix_pass_kernel(
    score_ptr, k1_ptr, k2_ptr, counts_ptr, C,
    PASS: tl.constexpr, PASSES: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    # counts[row, which, pass, d]: keys of prefix t_which (from the earlier passes) and
    # digit d, summed over all chunks with atomics
    follow(GDC)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    h1 = counts_ptr + (row * 2 + 0) * PASSES * (1 << BITS)
    h2 = counts_ptr + (row * 2 + 1) * PASSES * (1 << BITS)
    t1 = radix_threshold(h1, tl.load(k1_ptr + row), PASS, BITS)
    t2 = radix_threshold(h2, tl.load(k2_ptr + row), PASS, BITS)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    key = radix_keys(tl.load(score_ptr + row * C + idx, mask=valid, other=0.0))
    radix_count(key, valid, t1, t2, h1, h2, PASS, BITS)


@triton.jit
def _compact_prefix(src, n, t, PASS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                    dst, CAP):
    # copy the scores of src [n] whose keys match prefix t before pass PASS into dst (at
    # most CAP kept, in order) and return how many matched; the copies are visible to the
    # whole program on return
    hi = 32 - BITS * PASS
    found = tl.zeros([1], tl.int32)
    for c0 in range(0, n, BLOCK):
        idx = c0 + tl.arange(0, BLOCK)
        valid = idx < n
        s = tl.load(src + idx, mask=valid, other=0.0)
        m = (valid & ((radix_keys(s) >> hi) == (t >> hi))).to(tl.int32)
        pos = tl.sum(found, axis=0) + tl.cumsum(m, axis=0) - m
        tl.store(dst + pos, s, mask=(m > 0) & (pos < CAP))
        found += tl.sum(m, axis=0)
    tl.debug_barrier()
    return tl.sum(found, axis=0)


def _radix_rows_kernel(
    score_ptr, cand_ptr, ncand_ptr, k1_ptr, k2_ptr, counts_ptr, thr_ptr, C, CAP,
    FIRST: tl.constexpr, PASSES: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    CANDIDATES: tl.constexpr, COMPACT_AT: tl.constexpr, LIST_BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    # the radix passes FIRST.. of one row and threshold (which 0: k1, 1: k2), each over the
    # whole row, or over a list: with CANDIDATES the threshold's candidates (the scores
    # matching its prefix after FIRST passes, _radix_compact_kernel), with COMPACT_AT
    # (>= FIRST, > 0) the scores matching its prefix before that pass, which the program
    # copies into its list itself; a list that overflowed CAP is not walked (the row is).
    # Lists are walked LIST_BLOCK scores a step: a histogram costs every lane, masked or
    # not. counts[row, which, pass] of the passes before FIRST are given, the others
    # written; thr[row, which] receives the threshold (its uint32 key's bits)
    follow(GDC)
    row = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    k = tl.where(which == 0, tl.load(k1_ptr + row), tl.load(k2_ptr + row))
    hist = counts_ptr + (row * 2 + which) * PASSES * (1 << BITS)
    bins = tl.arange(0, 1 << BITS)
    src, n = score_ptr + row * C, C
    own = cand_ptr + (row * 2 + which) * CAP
    if CANDIDATES:
        listed = tl.load(ncand_ptr + row * 2 + which)
    t = tl.zeros([1], tl.uint32)
    above = tl.zeros([1], tl.int32)
    for p in tl.static_range(PASSES):
        if p < FIRST:
            h = tl.load(hist + p * (1 << BITS) + bins)
        else:
            prefix = tl.sum(t, axis=0)
            if COMPACT_AT > 0 and p == COMPACT_AT:
                listed = _compact_prefix(src, n, prefix, p, BITS, BLOCK, own, CAP)
            if CANDIDATES or (COMPACT_AT > 0 and p >= COMPACT_AT):
                if listed <= CAP:
                    h = radix_histogram(own, listed, prefix, p, BITS, LIST_BLOCK)
                else:
                    h = radix_histogram(src, n, prefix, p, BITS, BLOCK)
            else:
                h = radix_histogram(src, n, prefix, p, BITS, BLOCK)
            tl.store(hist + p * (1 << BITS) + bins, h)
        d, above = radix_digit(h[None, :], above, k, p, BITS)
        t = t | d
    tl.store(thr_ptr + row * 2 + which, tl.sum(t, axis=0).to(tl.int32, bitcast=True))


def _radix_compact_kernel(
    score_ptr, k1_ptr, k2_ptr, counts_ptr, cand_ptr, ncand_ptr, C, CAP,
    KEPT: tl.constexpr, PASSES: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    # append the scores of a chunk whose keys match threshold w's prefix after KEPT passes
    # to the row's candidate list of w (at most CAP kept; the count goes on past CAP)
    follow(GDC)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    s = tl.load(score_ptr + row * C + idx, mask=valid, other=0.0)
    key = radix_keys(s)
    hi = 32 - BITS * KEPT
    for w in tl.static_range(2):
        k = tl.load(k1_ptr + row) if w == 0 else tl.load(k2_ptr + row)
        hist = counts_ptr + (row * 2 + w) * PASSES * (1 << BITS)
        t = radix_threshold(hist, k, KEPT, BITS)
        match = valid & ((key >> hi) == (t >> hi))
        m = match.to(tl.int32)
        base = tl.atomic_add(ncand_ptr + row * 2 + w, tl.sum(m, axis=0))
        pos = base + tl.cumsum(m, axis=0) - m
        tl.store(cand_ptr + (row * 2 + w) * CAP + pos, s, mask=match & (pos < CAP))


# Programmatic dependent launch (sm_90 on) chains the selection's kernels after the score
# kernel. With one histogram for both thresholds where their prefixes agree (radix_count),
# H200 whole steps 0.416 / 0.410 / 0.752 ms against 0.421 / 0.418 / 0.763 at 8 x 512K /
# 4 x 1M / 8 x 1M
def chained(device: torch.device) -> dict[str, bool]:
    """Launch arguments of a selection kernel that follows another on its stream: ``GDC``,
    and ``launch_pdl`` where the device has programmatic dependent launch (CUDA, sm_90+)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return {"GDC": False}
    return {"GDC": True, "launch_pdl": True}


_RADIX_PASS = LazyKernel(_radix_pass_kernel)
_RADIX_ROWS = LazyKernel(_radix_rows_kernel)
_COMPACT = LazyKernel(_radix_compact_kernel)


def radix_thresholds(score: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
                     counts: torch.Tensor, ncand: torch.Tensor, thr: torch.Tensor,
                     first_pass: int, block: int, nchunk: int) -> None:
    """Run the radix passes ``first_pass..`` of both thresholds of every row.

    ``score [rows, C]`` float32, ``k1, k2 [rows]`` int32; ``counts [rows, 2, RADIX_PASSES,
    2**RADIX_BITS]`` int32 holds the passes before ``first_pass`` and receives the others;
    ``ncand [rows, 2]`` int32, zeros, receives the candidate counts (zeroed by the caller with
    ``counts``, so no fill runs between the selection's kernels).
    ``thr [rows, 2]`` int32 receives the ``k1``-th and ``k2``-th largest keys
    (:func:`radix_keys`, bits as int32), so the kernels after read them in one load instead
    of walking every pass's histogram (H200: the per-chunk counts 10.2 -> 7.6 us at
    8 x 128K, 15.3 -> 10.4 at 4 x 1M). ``block`` scores per (row, chunk) program and
    ``nchunk`` chunks per row, as the selection kernels use.
    """
    rows, num_clusters = score.shape
    radix = {"PASSES": RADIX_PASSES, "BITS": RADIX_BITS, "BLOCK": block}
    chain = chained(score.device)
    if num_clusters <= _ROW_RADIX_MAX:
        at = _ROW_COMPACT_AT if _ROW_COMPACT_AT >= max(1, first_pass) else 0
        cap = max(1, num_clusters // _CAND_FRACTION)
        cand = (torch.empty(rows, 2, cap, dtype=torch.float32, device=score.device) if at
                else score)
        _RADIX_ROWS[(rows, 2)](score, cand, counts, k1, k2, counts, thr,
                               num_clusters, cap, FIRST=first_pass, PASSES=RADIX_PASSES,
                               BITS=RADIX_BITS, BLOCK=_RADIX_BLOCK, CANDIDATES=False,
                               COMPACT_AT=at, LIST_BLOCK=_LIST_BLOCK, num_warps=_RADIX_WARPS,
                               **chain)
        return
    for p in range(first_pass, _KEPT):
        _RADIX_PASS[(rows, nchunk)](score, k1, k2, counts, num_clusters, PASS=p, **radix,
                                    **chain)
    cap = max(1, num_clusters // _CAND_FRACTION)
    cand = torch.empty(rows, 2, cap, dtype=torch.float32, device=score.device)
    _COMPACT[(rows, nchunk)](score, k1, k2, counts, cand, ncand, num_clusters, cap, KEPT=_KEPT,
                             **radix, **chain)
    _RADIX_ROWS[(rows, 2)](score, cand, ncand, k1, k2, counts, thr, num_clusters, cap,
                           FIRST=_KEPT, PASSES=RADIX_PASSES, BITS=RADIX_BITS,
                           BLOCK=_RADIX_BLOCK, CANDIDATES=True, COMPACT_AT=0,
                           LIST_BLOCK=_LIST_BLOCK, num_warps=_RADIX_WARPS, **chain)
