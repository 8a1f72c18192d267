"""Query plans: which units of each KV head are retrieved exactly and which estimated."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vecstore.config import LayerConfig
from vecstore.index.base import Index, IndexView

__all__ = ["QueryPlan", "make_plan", "zone_sizes"]


@dataclass(frozen=True, slots=True)
class QueryPlan:
    """The zones of one query over ``B`` sequences.

    Attributes
    ----------
    retrieve : torch.Tensor
        ``[B, Hkv, R]`` int64 unit ids fetched exactly, best first; ``-1`` pads.
    estimate : torch.Tensor
        ``[B, Hkv, E]`` int64 unit ids approximated by centroid and value sum; ``-1`` pads.
    """

    retrieve: torch.Tensor
    estimate: torch.Tensor


def zone_sizes(num_units: int, layer: LayerConfig, index: Index) -> tuple[int, int]:
    """Units retrieved and estimated for a sequence with ``num_units`` units."""
    if layer.exact or index.is_exact:
        return num_units, 0
    r = min(num_units, math.ceil(layer.retrieval_budget * num_units))
    e = 0
    if index.can_estimate:
        e = min(num_units - r, math.ceil(layer.estimation_budget * num_units))
    return r, e


def make_plan(index: Index, view: IndexView, q: torch.Tensor, scale: float,
              layer: LayerConfig) -> QueryPlan:
    """Rank every unit and cut the ranking into the retrieval and estimation zones.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hkv, G, L, D]`` float32 grouped queries.
    """
    B, H, C = view.sizes.shape
    counts = [zone_sizes(int(n), layer, index) for n in view.num_units.tolist()]
    r = torch.tensor([c[0] for c in counts], device=q.device)  # [B]
    e = torch.tensor([c[1] for c in counts], device=q.device)
    R, E = max(c[0] for c in counts), max(c[1] for c in counts)
    K = max(c[0] + c[1] for c in counts)
    scores = index.rank(view, q, scale)  # [B, H, C]
    ranked = torch.topk(scores, K, dim=-1).indices if K < C else torch.argsort(
        scores, dim=-1, descending=True)
    ranked = ranked.masked_fill(torch.gather(scores, -1, ranked) == float("-inf"), -1)
    pos_r = torch.arange(R, device=q.device)
    retrieve = ranked[..., :R].masked_fill(pos_r >= r[:, None, None], -1)
    pos_e = r[:, None, None] + torch.arange(E, device=q.device)  # [B, 1, E]
    estimate = torch.gather(ranked, -1, pos_e.clamp_max(max(K - 1, 0)).expand(B, H, E))
    estimate = estimate.masked_fill(pos_e >= (r + e)[:, None, None], -1)
    return QueryPlan(retrieve=retrieve, estimate=estimate)
