"""Exact references the approximate code is checked against (float64)."""

from __future__ import annotations

import torch


def exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float | None = None, softcap: float | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [Hq, L, D]`` over all of ``keys/values [Hkv, T, D]`` (GQA), in
    float64, the scores soft-capped by ``softcap`` if given. Returns ``out [Hq, L, D]`` and
    ``lse [Hq, L]``."""
    Hq, _, D = q.shape
    g = Hq // keys.shape[0]
    scale = D ** -0.5 if scale is None else scale
    k = keys.double().repeat_interleave(g, 0)
    v = values.double().repeat_interleave(g, 0)
    logits = scale * q.double() @ k.transpose(1, 2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|x - ref| / |ref|``."""
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def clustered_keys(num_heads: int, num_tokens: int, dim: int, num_centers: int,
                   spread: float, gen: torch.Generator) -> torch.Tensor:
    """Keys drawn from a Gaussian mixture: structure like real attention keys."""
    centers = 3.0 * torch.randn(num_heads, num_centers, dim, generator=gen)
    pick = torch.randint(0, num_centers, (num_heads, num_tokens), generator=gen)
    noise = spread * torch.randn(num_heads, num_tokens, dim, generator=gen)
    return torch.gather(centers, 1, pick[..., None].expand(-1, -1, dim)) + noise


def planted_clusters(num_problems: int, num_points: int, k: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-norm points ``[P, n, 16]`` in ``k`` tight groups of contiguous positions (as real
    keys near in position are), and each point's group ``[P, n]``."""
    gen = torch.Generator().manual_seed(seed)
    dirs = torch.nn.functional.normalize(torch.randn(num_problems, k, 16, generator=gen), dim=-1)
    pick = torch.arange(num_points) * k // num_points
    x = dirs[:, pick] + 0.02 * torch.randn(num_problems, num_points, 16, generator=gen)
    return torch.nn.functional.normalize(x, dim=-1), pick.expand(num_problems, -1)


def rows_apart(view, gap: int):
    """``view`` with each (sequence, head)'s rows ``gap`` rows further apart than their
    length, as a tier's reserve keeps them; the rows between are NaN, so an executor
    reading them would show."""
    from vecstore.index.base import IndexView

    B, heads, n, dim = view.keys.shape
    spread = []
    for x in (view.keys, view.values):
        reserve = torch.full((B, heads, n + gap, dim), float("nan"), dtype=x.dtype)
        reserve[:, :, :n] = x
        spread.append(reserve[:, :, :n])
    return IndexView(keys=spread[0], values=spread[1], offsets=view.offsets,
                     sizes=view.sizes, meta=view.meta, num_units=view.num_units)
