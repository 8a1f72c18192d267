"""Float64 oracles written as loops over the definitions, and helpers of the kernel tests.

The kernels are tested against the library's torch reference
(:mod:`vecstore.kernels.reference`) run in float64; the loops here check that reference
itself, independently of its vectorised code.
"""

from __future__ import annotations

import math

import torch

from vecstore.kernels.reference import merge
from vecstore.kernels.zones import Zones

NEG_INF = float("-inf")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Relative L2 error allowed per input dtype (interpreter and GPU alike).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The relative L2 error allowed for inputs of ``dtype`` on ``device``: compiled kernels
    multiply float32 operands in TF32 (``tl.dot``'s default on the GPU, a 10-bit mantissa),
    the interpreter in float32."""
    return 5e-3 if dtype == torch.float32 and device.type == "cuda" else TOLERANCE[dtype]


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|x - ref| / |ref|`` in float64 (``inf`` if ``x`` holds NaN)."""
    x64, ref64 = x.double().cpu(), ref.double().cpu()
    if torch.isnan(x64).any():
        return math.inf
    return float((x64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def assert_state_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
                       ref_lse: torch.Tensor, tol: float) -> None:
    """Check an attention state ``(out, lse)`` against its float64 reference.

    Empty rows (``ref_lse == -inf``) must give exactly ``lse = -inf`` and ``out = 0``; the rest
    must be within ``tol`` relative L2 error, and nothing may be NaN.
    """
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = ref_out.cpu().reshape(out.shape), ref_lse.cpu().reshape(lse.shape)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "empty rows differ"
    assert torch.all(out[empty] == 0), "empty rows must have out = 0"
    full = ~empty
    if full.any():
        assert rel_l2(out[full], ref_out[full]) < tol, rel_l2(out[full], ref_out[full])
        assert rel_l2(lse[full], ref_lse[full]) < tol, rel_l2(lse[full], ref_lse[full])


def merged_parts(parts: tuple[torch.Tensor, torch.Tensor], lo: int,
                 hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 merge (:func:`vecstore.kernels.reference.merge`) of the partial states
    ``lo:hi`` of ``parts = ([rows, P, D], [rows, P])``: ``out [rows, D]``, ``lse [rows]``."""
    out = torch.zeros(parts[0].shape[0], parts[0].shape[2], dtype=torch.float64)
    lse = torch.full((parts[1].shape[0],), NEG_INF, dtype=torch.float64)
    for p in range(lo, hi):
        out, lse = merge(out, lse, parts[0][:, p].double().cpu(), parts[1][:, p].double().cpu())
    return out, lse


def empty_parts(rows: int, num_parts: int, dim: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial-state buffers filled with NaN, so a part a kernel should write and did not
    shows."""
    return (torch.full((rows, num_parts, dim), float("nan"), device=device),
            torch.full((rows, num_parts), float("nan"), device=device))


def clustered(rows: int, num_clusters: int, max_size: int, gen: torch.Generator,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster sizes ``[rows, C]`` int32 (some 0) and first rows (cluster-contiguous)."""
    sizes = torch.randint(0, max_size + 1, (rows, num_clusters), generator=gen,
                          dtype=torch.int32)
    return sizes, (torch.cumsum(sizes, 1) - sizes).int()


def make_zones(sizes: torch.Tensor, first: torch.Tensor, retrieved: list[list[int]],
               estimated: list[list[int]], r_max: int, e_max: int) -> Zones:
    """The zones of hand-picked retrieved and estimated clusters per row (cluster order)."""
    rows, num_clusters = sizes.shape
    z = Zones.empty(rows, num_clusters, r_max, torch.device("cpu"), e_max)
    z.zone.zero_()
    z.cum.zero_()
    z.ids.fill_(-1)
    z.est_ids.fill_(-1)
    for r in range(rows):
        ret, est = sorted(retrieved[r]), sorted(estimated[r])
        z.zone[r, ret], z.zone[r, est] = 1, 2
        z.ids[r, :len(ret)] = torch.tensor(ret, dtype=torch.int32)
        z.first_row[r, :len(ret)] = first[r, ret]
        z.cum[r, :len(ret) + 1] = torch.tensor([0, *torch.cumsum(sizes[r, ret], 0).tolist()])
        z.count[r] = len(ret)
        z.est_ids[r, :len(est)] = torch.tensor(est, dtype=torch.int32)
        z.est_count[r] = len(est)
    return z


def on(zones: Zones, device: torch.device) -> Zones:
    """``zones`` with every tensor on ``device``."""
    return Zones(*(getattr(zones, f).to(device) for f in Zones.__slots__))


def ref_centroid_scores(q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``logits [B, Hq, C]`` (``-inf`` for empty clusters) and group score
    ``[B, Hkv, C]``: each head's softmax over clusters summed over its group, ``-inf`` for
    empty clusters."""
    batch, num_q_heads, _ = q.shape
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


def ref_estimate(logits: torch.Tensor, sizes: torch.Tensor, value_sums: torch.Tensor,
                 est_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 estimation-zone state of ``logits [B, Hq, C]`` over clusters ``est_ids
    [B, Hkv, E]`` (``-1`` pads), written as the explicit loop of the definition."""
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


def ref_attention_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       rows: list[list[list[int]]],
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
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
