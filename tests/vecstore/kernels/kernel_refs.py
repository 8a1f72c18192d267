"""Float64 references and comparison helpers for the decode-kernel tests."""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (B, Hkv, G, D): GQA ratios 1, 3 and 4, head dims 64 and 128; small enough for the
# interpreter, long enough (with the lengths the tests pick) that the kernels use several splits.
SHAPES = ((2, 2, 1, 64), (1, 2, 3, 128), (2, 1, 4, 64))

# Relative L2 error allowed per input dtype (interpreter and GPU alike).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|x - ref| / |ref|`` in float64 (``inf`` if ``x`` holds NaN)."""
    x64, ref64 = x.double(), ref.double()
    if torch.isnan(x64).any():
        return math.inf
    return float((x64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def assert_state_close(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    tol: float,
) -> None:
    """Check an attention state ``(out, lse)`` against its float64 reference.

    Empty rows (``ref_lse == -inf``) must give exactly ``lse = -inf`` and ``out = 0``; the rest
    must be within ``tol`` relative L2 error, and nothing may be NaN.
    """
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref_out, ref_lse = ref_out.to(out.device), ref_lse.to(out.device)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "empty rows differ"
    assert torch.all(out[empty] == 0), "empty rows must have out = 0"
    full = ~empty
    if full.any():
        assert rel_l2(out[full], ref_out[full]) < tol, rel_l2(out[full], ref_out[full])
        assert rel_l2(lse[full], ref_lse[full]) < tol, rel_l2(lse[full], ref_lse[full])


def poisoned(*shapes_dtypes: tuple[tuple[int, ...], torch.dtype], device: torch.device):
    """Return output tensors filled with NaN (floats) or a sentinel (ints), one per spec."""
    outs = []
    for shape, dtype in shapes_dtypes:
        fill = float("nan") if dtype.is_floating_point else -(2**40)
        outs.append(torch.full(shape, fill, dtype=dtype, device=device))
    return tuple(outs)


def ref_centroid_scores(
    q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``logits [B, Hq, C]`` (``-inf`` for empty clusters) and group score ``[B, Hkv, C]``.

    The score is the per-head softmax over clusters summed over the group; ``-inf`` for empty
    clusters.
    """
    batch, num_q_heads, dim = q.shape
    num_kv_heads, num_clusters = centroids.shape[1], centroids.shape[2]
    group = num_q_heads // num_kv_heads
    cents = centroids.double().repeat_interleave(group, dim=1)  # [B, Hq, C, D]
    logits = torch.einsum("bhd,bhcd->bhc", q.double(), cents) * scale
    empty = (sizes <= 0).repeat_interleave(group, dim=1)
    logits = logits.masked_fill(empty, NEG_INF)
    probs = torch.zeros_like(logits)
    for b in range(batch):
        for h in range(num_q_heads):
            if not empty[b, h].all():
                probs[b, h] = torch.softmax(logits[b, h], dim=-1)
    score = probs.view(batch, num_kv_heads, group, num_clusters).sum(dim=2)
    return logits, score.masked_fill(sizes <= 0, NEG_INF)


def ref_estimate(
    logits: torch.Tensor, sizes: torch.Tensor, value_sums: torch.Tensor, est_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 estimation-zone state, written as the explicit loop of the definition."""
    batch, num_q_heads, num_clusters = logits.shape
    num_kv_heads, dim = sizes.shape[1], value_sums.shape[-1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, dim, dtype=torch.float64)
    lse = torch.full((batch, num_q_heads), NEG_INF, dtype=torch.float64)
    for b in range(batch):
        for h in range(num_q_heads):
            kv = h // group
            chosen = [
                int(j) for j in est_ids[b, kv] if 0 <= j < num_clusters and sizes[b, kv, j] > 0
            ]
            if not chosen:
                continue
            n = sizes[b, kv, chosen].double()
            w = logits[b, h, chosen].double() + n.log()
            lse[b, h] = torch.logsumexp(w, dim=0)
            weights = torch.exp(w - lse[b, h]) / n
            out[b, h] = weights @ value_sums[b, kv, chosen].double()
    return out, lse


def ref_attention_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: list[list[list[int]]],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention state of ``q [B, Hq, D]`` over the listed rows of each KV head.

    ``rows[b][h]`` lists row indices into ``keys[b, h]`` / ``values[b, h]`` (``[B, Hkv, N, D]``).
    """
    batch, num_q_heads, dim = q.shape
    group = num_q_heads // keys.shape[1]
    out = torch.zeros(batch, num_q_heads, dim, dtype=torch.float64)
    lse = torch.full((batch, num_q_heads), NEG_INF, dtype=torch.float64)
    for b in range(batch):
        for h in range(num_q_heads):
            picked = rows[b][h // group]
            if not picked:
                continue
            k = keys[b, h // group, picked].double()
            v = values[b, h // group, picked].double()
            s = scale * (k @ q[b, h].double())
            lse[b, h] = torch.logsumexp(s, dim=0)
            out[b, h] = torch.softmax(s, dim=0) @ v
    return out, lse
