"""The reference executor in plain torch (CPU and CUDA): the torch reference of the kernels
(:mod:`vecstore.kernels.reference`) run over a query plan, the yardstick for every executor."""

from __future__ import annotations

from typing import cast

import torch

from vecstore.config import LayerConfig
from vecstore.executor.base import EXECUTORS, Steady
from vecstore.executor.numba_gather import gather_clusters
from vecstore.executor.plan import make_plan
from vecstore.index.base import EstimatingIndex, Index, IndexView, UnitSummary
from vecstore.kernels.reference import attend, estimate, merge
from vecstore.slicing import query_slices
from vecstore.types import QueryStats

__all__ = ["TorchExecutor", "gather_units", "estimate_units"]


def gather_units(view: IndexView, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """Gather the rows of units ``ids`` (``[B, Hkv, R]``, -1 = none) back to back.

    On the CPU the copy is Numba's parallel block gather; elsewhere a torch gather.
    Returns keys and values ``[B, Hkv, M, D]`` and a validity mask ``[B, Hkv, M]``.
    """
    B, H, R = ids.shape
    N, D = view.keys.shape[2:]
    safe = ids.clamp_min(0)
    starts = torch.gather(view.offsets, -1, safe)  # [B, H, R]
    lens = torch.gather(view.sizes, -1, safe) * (ids >= 0)
    per_head = lens.sum(-1).reshape(B * H)
    M = int(per_head.max()) if per_head.numel() else 0
    valid = (torch.arange(M, device=ids.device) < per_head[:, None]).reshape(B, H, M)
    if view.keys.device.type == "cpu":
        # host rows (also a pinned tier under a GPU query): gathered on the host, then moved
        rows = (starts.reshape(B * H, R).cpu(), lens.reshape(B * H, R).cpu())
        k = gather_clusters(view.keys.reshape(B * H, N, D), *rows,
                            out=view.keys.new_zeros(B * H, M, D)).out
        v = gather_clusters(view.values.reshape(B * H, N, D), *rows,
                            out=view.values.new_zeros(B * H, M, D)).out
        return k.reshape(B, H, M, D).to(ids.device), v.reshape(B, H, M, D).to(ids.device), valid
    starts, lens = starts.reshape(-1), lens.reshape(-1)
    total = int(lens.sum())
    dev = ids.device
    unit_of = torch.repeat_interleave(torch.arange(B * H * R, device=dev), lens)  # [total]
    unit_base = torch.cumsum(lens, 0) - lens
    row = starts[unit_of] + torch.arange(total, device=dev) - unit_base[unit_of]
    head = unit_of // R
    head_base = torch.cumsum(per_head, 0) - per_head
    slot = torch.arange(total, device=dev) - head_base[head]
    index = torch.zeros(B * H, M, dtype=torch.long, device=dev)
    index[head, slot] = row
    gidx = index[..., None].expand(-1, -1, D)
    k = torch.gather(view.keys.reshape(B * H, N, D), 1, gidx)
    v = torch.gather(view.values.reshape(B * H, N, D), 1, gidx)
    return k.reshape(B, H, M, D), v.reshape(B, H, M, D), valid


def estimate_units(view: IndexView, summary: UnitSummary, ids: torch.Tensor, q: torch.Tensor,
                   scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over units ``ids`` (``[B, Hkv, E]``, -1 = none) of ``view`` approximated by
    their centroids and value sums (``summary``, :func:`vecstore.kernels.reference.estimate`),
    the centroid scores soft-capped by ``softcap`` if given.

    Returns ``out [B, Hkv, G, L, D]`` and ``lse [B, Hkv, G, L]`` (float32) of grouped queries
    ``q [B, Hkv, G, L, D]``.
    """
    return estimate(q, *_estimation_zone(view, summary, ids), scale, softcap)


def _estimation_zone(view: IndexView, summary: UnitSummary, ids: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centroids ``[B, H, E, D]``, log sizes ``[B, H, E]`` (``-inf`` pads) and mean values
    of units ``ids``: what :func:`estimate_units` needs, gathered once for all queries."""
    safe = ids.clamp_min(0)
    D = summary.centroids.shape[-1]
    gidx = safe[..., None].expand(-1, -1, -1, D)
    cent = torch.gather(summary.centroids, 2, gidx)  # [B, H, E, D]
    vsum = torch.gather(summary.value_sums, 2, gidx)
    size = (torch.gather(view.sizes, -1, safe) * (ids >= 0)).float()  # [B, H, E]
    return cent, size.log(), vsum / size.clamp_min(1.0)[..., None]


@EXECUTORS.register("torch")
class TorchExecutor:
    """Tripartite attention with plain torch ops, computed in float32.

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> from vecstore.index.wave import WaveIndex
    >>> idx = WaveIndex(StoreConfig())
    >>> view = IndexView.from_segments(idx.build(torch.randn(2, 64, 8), torch.randn(2, 64, 8), 0))
    >>> steady = Steady(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.tensor([3]))
    >>> layer = StoreConfig().for_layer(0)
    >>> q = torch.randn(1, 4, 1, 8)
    >>> out, lse, stats = TorchExecutor().run(idx, view, steady, q, 0.35, layer)
    >>> out.shape, stats.units_retrieved
    (torch.Size([1, 4, 1, 8]), 2)
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def run(
        self, index: Index, view: IndexView | None, steady: Steady, q: torch.Tensor,
        scale: float, layer: LayerConfig, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, QueryStats]:
        # The retrieval clusters are ranked by the uncapped scores (a soft-cap is monotonic:
        # one query head ranks the same either way; see the Executor protocol).
        # A query of L > 1 tokens (a prefill chunk) runs in slices of its tokens, so no
        # [B, Hkv, G, L, columns] score tensor is held whole (vecstore.slicing): the plan
        # is one for all L tokens (the ranking sums over them), the zones are gathered
        # once, and each slice attends to them on its own.
        B, Hq, L, D = q.shape
        H = steady.keys.shape[1]
        G = Hq // H
        S = steady.keys.shape[2]
        s_valid = (torch.arange(S, device=q.device) < steady.lengths[:, None])[:, None, :]
        s_valid = s_valid.expand(B, H, S)
        exact_rows = steady.lengths.float() * H
        total_rows = exact_rows.clone()
        retrieved = estimated = 0
        columns = S
        rows = zone = None
        qf = q.float().reshape(B, H, G, L, D)
        if view is not None:
            plan = make_plan(index, view, qf, scale, layer)
            rows = gather_units(view, plan.retrieve)
            exact_rows = exact_rows + rows[2].sum(dim=(1, 2)).float()
            total_rows = total_rows + view.sizes.sum(dim=(1, 2)).float()
            retrieved = int((plan.retrieve >= 0).sum())
            estimated = int((plan.estimate >= 0).sum())
            columns = max(columns, rows[0].shape[2])
            if estimated:  # only an EstimatingIndex plans an estimation zone
                summary = cast(EstimatingIndex, index).summarize(view)
                zone = _estimation_zone(view, summary, plan.estimate)
                columns = max(columns, plan.estimate.shape[2])
        parts = query_slices(L, columns, rows=B * Hq)
        if len(parts) > 1:
            out = torch.empty(B, Hq, L, D, dtype=q.dtype, device=q.device)
            lse = torch.empty(B, Hq, L, device=q.device)
        if rows is not None and len(parts) > 1:  # converted once, not once per slice
            rows = (rows[0].float(), rows[1].float(), rows[2])
        mass = torch.zeros((), dtype=torch.float64, device=q.device)
        for part in parts:
            qg = qf[:, :, :, part]  # [B, Hkv, G, l, D]
            o, s = attend(qg, steady.keys, steady.values, s_valid, scale, softcap)
            if rows is not None:
                o, s = merge(o, s, *attend(qg, rows[0], rows[1], rows[2], scale, softcap))
            if zone is not None:
                o_e, s_e = estimate(qg, *zone, scale, softcap)
                o, s_all = merge(o, s, o_e, s_e)
                mass += torch.exp(s_e - s_all).nan_to_num_(0.0).sum(dtype=torch.float64)
                s = s_all
            if len(parts) == 1:
                out, lse = o.reshape(B, Hq, L, D).to(q.dtype), s.reshape(B, Hq, L)
                break
            out[:, :, part] = o.reshape(B, Hq, -1, D)
            lse[:, :, part] = s.reshape(B, Hq, -1)
        stats = QueryStats(
            tokens_total=round(float(total_rows.sum()) / H),
            tokens_exact=round(float(exact_rows.sum()) / H),
            units_retrieved=retrieved, units_estimated=estimated,
            estimated_mass=float(mass) / (B * Hq * L) if estimated else 0.0,
        )
        return out, lse, stats
