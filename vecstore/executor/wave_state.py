"""What the wave executor keeps per view and produces per step (no Triton needed to import)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vecstore.buffer.wave_buffer import WaveBuffer
from vecstore.executor.base import Steady
from vecstore.index.base import IndexView

__all__ = ["Zones", "PreparedView", "DecodeResult", "CapturedStep", "step_stats"]


@dataclass(frozen=True, slots=True)
class Zones:
    """Per-row output of :func:`select_zones` (rows ``b * Hkv + h``).

    Attributes
    ----------
    zone : torch.Tensor
        ``[rows, C]`` int8: 1 retrieved, 2 estimated, 0 dropped.
    ids : torch.Tensor
        ``[rows, R]`` int32 retrieved cluster ids in cluster order (first ``count`` valid).
    first_row : torch.Tensor
        ``[rows, R]`` int32 first KV row of each retrieved cluster.
    cum : torch.Tensor
        ``[rows, R + 1]`` int32 running sum of retrieved sizes: cluster ``i`` fills
        execution rows ``cum[i]:cum[i + 1]``; ``cum[count]`` is the row total.
    count : torch.Tensor
        ``[rows]`` int32 retrieved clusters.
    est_ids : torch.Tensor
        ``[rows, E]`` int32 estimated cluster ids in cluster order (first ``est_count``
        valid; none kept when ``E`` is 0).
    est_count : torch.Tensor
        ``[rows]`` int32 estimated clusters.
    """

    zone: torch.Tensor
    ids: torch.Tensor
    first_row: torch.Tensor
    cum: torch.Tensor
    count: torch.Tensor
    est_ids: torch.Tensor
    est_count: torch.Tensor

    def rows(self, start: int, stop: int) -> Zones:
        """The zones of rows ``start:stop`` (views: writing them writes these)."""
        return Zones(*(getattr(self, f)[start:stop] for f in Zones.__slots__))

    @staticmethod
    def empty(rows: int, num_clusters: int, r_max: int, device: torch.device,
              e_max: int = 0) -> Zones:
        """Buffers for ``rows`` rows of ``num_clusters`` clusters, at most ``r_max`` retrieved
        and ``e_max`` estimated ids kept."""
        i32 = torch.int32
        return Zones(
            zone=torch.empty(rows, num_clusters, dtype=torch.int8, device=device),
            ids=torch.empty(rows, r_max, dtype=i32, device=device),
            first_row=torch.empty(rows, r_max, dtype=i32, device=device),
            cum=torch.empty(rows, r_max + 1, dtype=i32, device=device),
            count=torch.empty(rows, dtype=i32, device=device),
            est_ids=torch.empty(rows, e_max, dtype=i32, device=device),
            est_count=torch.empty(rows, dtype=i32, device=device),
        )


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
        Largest ``k1``.
    e_max : int
        Largest ``k2 - k1``.
    max_rows : int
        Most rows the retrieved clusters of a row can hold (its ``r_max`` largest
        clusters): the execution buffer's length.
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
