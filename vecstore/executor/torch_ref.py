"""The reference executor in plain torch (CPU and CUDA), the yardstick for every kernel."""

from __future__ import annotations

import torch

from vecstore.config import LayerConfig
from vecstore.executor.base import EXECUTORS, Steady
from vecstore.executor.merge import attend, merge
from vecstore.executor.numba_gather import gather_clusters
from vecstore.executor.plan import QueryPlan, make_plan
from vecstore.index.base import Index, IndexView
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


def estimate_units(view: IndexView, ids: torch.Tensor, q: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over units ``ids`` approximated by their centroids and value sums.

    Every key of unit ``j`` is replaced by its mean ``c_j``: the unit contributes
    ``n_j e^{s q·c_j}`` to the denominator (a lower bound of its true mass, by Jensen)
    and ``e^{s q·c_j} VS_j`` to the numerator.

    Returns ``out [B, Hkv, G, L, D]`` and ``lse [B, Hkv, G, L]`` (float32).
    """
    safe = ids.clamp_min(0)
    D = view.meta["centroids"].shape[-1]
    gidx = safe[..., None].expand(-1, -1, -1, D)
    cent = torch.gather(view.meta["centroids"], 2, gidx)  # [B, H, E, D]
    vsum = torch.gather(view.meta["value_sums"], 2, gidx)
    size = (torch.gather(view.sizes, -1, safe) * (ids >= 0)).float()  # [B, H, E]
    logits = scale * torch.einsum("bhgld,bhed->bhgle", q, cent) + size.log()[:, :, None, None]
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    vmean = vsum / size.clamp_min(1.0)[..., None]
    return torch.einsum("bhgle,bhed->bhgld", probs, vmean), lse


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
        scale: float, layer: LayerConfig,
    ) -> tuple[torch.Tensor, torch.Tensor, QueryStats]:
        B, Hq, L, D = q.shape
        H = steady.keys.shape[1]
        qg = q.float().reshape(B, H, Hq // H, L, D)  # [B, Hkv, G, L, D]
        S = steady.keys.shape[2]
        s_valid = (torch.arange(S, device=q.device) < steady.lengths[:, None])[:, None, :]
        out, lse = attend(qg, steady.keys, steady.values, s_valid.expand(B, H, S), scale)
        exact_rows = steady.lengths.float() * H
        total_rows = exact_rows.clone()
        retrieved = estimated = 0
        mass = 0.0
        if view is not None:
            plan = make_plan(index, view, qg, scale, layer)
            out, lse, got = self._retrieve(view, plan, qg, scale, out, lse)
            exact_rows = exact_rows + got
            total_rows = total_rows + view.sizes.sum(dim=(1, 2)).float()
            retrieved = int((plan.retrieve >= 0).sum())
            estimated = int((plan.estimate >= 0).sum())
            if estimated:
                out_e, lse_e = estimate_units(view, plan.estimate, qg, scale)
                out, lse_all = merge(out, lse, out_e, lse_e)
                share = torch.exp(lse_e - lse_all).nan_to_num(0.0)
                mass, lse = float(share.mean()), lse_all
        stats = QueryStats(
            tokens_total=round(float(total_rows.sum()) / H),
            tokens_exact=round(float(exact_rows.sum()) / H),
            units_retrieved=retrieved, units_estimated=estimated, estimated_mass=mass,
        )
        return (out.reshape(B, Hq, L, D).to(q.dtype), lse.reshape(B, Hq, L), stats)

    @staticmethod
    def _retrieve(view: IndexView, plan: QueryPlan, qg: torch.Tensor, scale: float,
                  out: torch.Tensor, lse: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v, valid = gather_units(view, plan.retrieve)
        out_r, lse_r = attend(qg, k, v, valid, scale)
        out, lse = merge(out, lse, out_r, lse_r)
        return out, lse, valid.sum(dim=(1, 2)).float()
