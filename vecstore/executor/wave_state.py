"""What the wave executor keeps per view and produces per step (no Triton needed to import)."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from vecstore.buffer.cache_fill import can_take_over, take_over, warm
from vecstore.buffer.wave_buffer import WaveBuffer
from vecstore.config import LayerConfig
from vecstore.executor.base import Steady
from vecstore.executor.plan import zone_sizes
from vecstore.executor.sq8 import quantize
from vecstore.index.base import Index, IndexView, UnitSummary
from vecstore.kernels.zones import Zones
from vecstore.kvstore.base import MemoryAccount

__all__ = ["PreparedView", "DecodeResult", "CapturedStep", "step_stats", "add_step_stats",
           "prepare_view"]


@dataclass
class PreparedView:
    """What the decode step needs of one layer's view, built once per view and budget.

    Attributes
    ----------
    view : IndexView
        The source view (kept alive so its id stays unique).
    centroids : torch.Tensor
        ``[B, Hkv, C, D]`` in the scoring dtype (int8 codes for ``score_dtype=torch.int8``).
    vmean : torch.Tensor
        ``[rows, C, D]`` value means ``VS_j / n_j`` in the KV dtype.
    sizes, first_row : torch.Tensor
        ``[rows, C]`` int32.
    keys, values : torch.Tensor
        ``[rows, N, D]`` the KV rows (GPU, or host memory for an offloaded view).
    k1, k2 : torch.Tensor
        ``[rows]`` int32 retrieved, and retrieved plus estimated, clusters per row.
    r_max : int
        Largest ``k1``, rounded up to a multiple of 16 (so is every capacity here).
    e_max : int
        Largest ``k2 - k1``, rounded up.
    max_rows : int
        Most rows the retrieved clusters of a row can hold (its ``k1`` largest
        clusters), rounded up: the execution buffer's length.
    tokens_total : int
        Indexed tokens over all rows, per KV head.
    buffer : WaveBuffer | None
        The block cache of an offloaded view.
    radii : torch.Tensor | None
        ``[rows, C]`` float32 cluster radii, or ``None`` when ranking by centroids alone.
    radius_weight : float
        The index's ``radius_weight`` (0.0 without radii).
    code_scales : torch.Tensor | None
        ``[rows, C]`` float32 scales of int8 centroid codes (:mod:`~vecstore.executor.sq8`).
    graph : CapturedStep | None
        The captured decode step (CUDA).
    """

    view: IndexView
    centroids: torch.Tensor
    vmean: torch.Tensor
    sizes: torch.Tensor
    first_row: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    k1: torch.Tensor
    k2: torch.Tensor
    r_max: int
    e_max: int
    max_rows: int
    tokens_total: int
    buffer: WaveBuffer | None
    radii: torch.Tensor | None
    radius_weight: float
    code_scales: torch.Tensor | None = None
    graph: CapturedStep | None = None


@dataclass(frozen=True, slots=True)
class CapturedStep:
    """A captured decode step and its static inputs and outputs."""

    key: tuple
    graph: torch.cuda.CUDAGraph
    q: torch.Tensor
    steady: Steady
    res: DecodeResult
    stats: torch.Tensor | None = None  # the step's QueryStats fields, computed in the graph


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """Device outputs of one decode step.

    Attributes
    ----------
    out : torch.Tensor
        ``[B, Hq, D]`` in the query dtype.
    lse : torch.Tensor
        ``[B, Hq]`` float32.
    zones : Zones
        The step's retrieval and estimation zones.
    parts_lse : torch.Tensor
        ``[B * Hq, P]`` float32 partial log-sum-exps (retrieved, steady, estimated splits).
    num_exact_parts : int
        Leading parts that are exact (retrieved and steady); the rest are estimated.
    """

    out: torch.Tensor
    lse: torch.Tensor
    zones: Zones
    parts_lse: torch.Tensor
    num_exact_parts: int


def step_stats(res: DecodeResult, steady_lengths: torch.Tensor, indexed: int, H: int,
               ) -> torch.Tensor:
    """The step's :class:`QueryStats` fields as a float64 ``[5]`` tensor on the device,
    computed without a host sync: tokens total and exact (per KV head), units retrieved and
    estimated, and the estimation zone's mean share of the softmax mass (0 when no unit was
    estimated). ``indexed`` is the view's token count over all rows and heads."""
    zones = res.zones
    exact = zones.cum.gather(1, zones.count[:, None].long()).sum()
    retrieved, estimated = zones.count.sum(), zones.est_count.sum()
    lse_e = torch.logsumexp(res.parts_lse[:, res.num_exact_parts:], dim=1)
    share = torch.exp(lse_e - res.lse.reshape(-1)).nan_to_num(0.0)
    mass = torch.where(estimated > 0, share.mean().double(), 0.0)
    steady_rows = steady_lengths.sum().to(exact.device)
    # float64 arithmetic equals Python's on these integers (all below 2**53); round() and
    # torch.round both round half to even
    total = (steady_rows + indexed // H).double()
    tokens_exact = torch.round((steady_rows * H + exact).double() / H)
    return torch.stack([total, tokens_exact, retrieved.double(), estimated.double(), mass])


def add_step_stats(res: DecodeResult, steady_lengths: torch.Tensor, indexed: int, H: int,
                   stats: torch.Tensor, checked: tuple[torch.Tensor, ...] = (),
                   finite: torch.Tensor | None = None) -> None:
    """Add :func:`step_stats` to the float64 ``[5]`` ``stats`` in one Triton launch, and clear
    the int32 ``finite`` flag if a tensor of ``checked`` holds a NaN or Inf
    (:func:`vecstore.kernels.step_stats.accumulate_step`; CUDA, or the interpreter)."""
    # triton is imported here, not at module import: it is an optional dependency
    from vecstore.kernels.step_stats import accumulate_step

    z = res.zones
    accumulate_step(z.cum, z.count, z.est_count, res.parts_lse, res.num_exact_parts, res.lse,
                    steady_lengths, indexed, H, stats, checked, finite)


def prepare_view(view: IndexView, summary: UnitSummary, layer: LayerConfig, index: Index, *,
                 score_dtype: torch.dtype | None, offload: bool, cache_policy: str,
                 cache_capacity: float, slot_tokens: int,
                 accounts: Callable[[torch.device], MemoryAccount] | None = None,
                 policy_worker: Executor | None = None,
                 predecessor: WaveBuffer | None = None) -> PreparedView:
    """The decode-ready form of ``view`` (its units summarized by ``index`` as ``summary``)
    for ``layer``'s budgets: per-row zone sizes, value means, centroids in ``score_dtype``
    (int8 codes and their scales for ``torch.int8``, the KV dtype for ``None``), and a
    :class:`WaveBuffer` (``cache_policy``, ``cache_capacity`` of the clusters, ``slot_tokens``
    rows a slot; its policy records applied on ``policy_worker``; holding what
    ``predecessor``, the buffer of a view this one extends, held, its free slots filled
    with the newest clusters: :mod:`vecstore.buffer.cache_fill`) when the rows are not on
    the centroids' device or ``offload`` asks for one. ``predecessor`` is left open."""
    B, H, C = view.sizes.shape
    N, D = view.keys.shape[2:]
    rows = B * H
    dev = summary.centroids.device
    kv_dtype = view.keys.dtype
    counts = [zone_sizes(int(n), layer, index) for n in view.num_units.tolist()]
    k1 = torch.tensor([r for r, _ in counts], dtype=torch.int32).repeat_interleave(H)
    k2 = torch.tensor([r + e for r, e in counts], dtype=torch.int32).repeat_interleave(H)
    k1_max = max(1, int(k1.max()))
    r_max, e_max = _capacity(k1_max), _capacity(int((k2 - k1).max()))
    sizes = view.sizes.reshape(rows, C)
    vmean = summary.value_sums / sizes.clamp_min(1)[..., None].reshape(B, H, C, 1)
    cent, code_scales = summary.centroids, None
    if score_dtype == torch.int8:
        cent, code_scales = quantize(cent)
        code_scales = code_scales.reshape(rows, C).contiguous()
    else:
        cent = cent.to(score_dtype or kv_dtype).contiguous()
    keys = view.keys.reshape(rows, N, D)
    values = view.values.reshape(rows, N, D)
    # the execution buffer fits the k1 largest clusters of any row
    top = torch.sort(sizes, dim=1, descending=True).values[:, :k1_max].sum(1)
    max_rows = _capacity(int(top.max()))
    sizes_dev = sizes.to(dev, torch.int32).contiguous()
    first_row = view.offsets[..., :-1].reshape(rows, C).to(dev, torch.int32).contiguous()
    buffer = None
    if keys.device != dev or offload:  # offloaded: the block cache serves, filled at once
        buffer = WaveBuffer(
            keys, values, num_clusters=C, r_max=r_max, exec_rows=max_rows,
            num_slots=max(1, math.ceil(cache_capacity * C)),
            slot_tokens=slot_tokens, device=dev, policy=cache_policy,
            account=None if accounts is None else accounts(dev), policy_worker=policy_worker)
        if predecessor is not None and can_take_over(buffer, predecessor):
            take_over(buffer, predecessor)
        warm(buffer, sizes_dev, first_row)
    weight = float(summary.radius_weight)
    radii = (summary.radii.reshape(rows, C).to(dev, torch.float32).contiguous()
             if weight else None)
    return PreparedView(
        view=view, centroids=cent, vmean=vmean.to(kv_dtype).reshape(rows, C, D).contiguous(),
        sizes=sizes_dev, first_row=first_row, keys=keys, values=values, k1=k1.to(dev),
        k2=k2.to(dev), r_max=r_max, e_max=e_max, max_rows=max_rows,
        tokens_total=int(view.sizes.sum()), buffer=buffer,
        radii=radii, radius_weight=weight, code_scales=code_scales,
    )


def _capacity(n: int) -> int:
    """``n`` (at least 1) rounded up to a multiple of 16: the zone and row-map capacities
    are kernel arguments, which Triton specializes on divisibility by 16, so capacities that
    drifted across that line as a layer grew made the kernels compile again."""
    return -(-max(1, n) // 16) * 16
