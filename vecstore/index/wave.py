"""The wave index: segmented spherical k-means over keys (RetroInfer, Chen et al. 2025).

Keys of each KV head are cut into segments of about ``segment_tokens``; every
(head, segment) is clustered on its own, all of them batched into one set of matrix
products. Per cluster the index keeps its mean key (centroid), radius (largest distance
from the centroid to a member key), size and value sum, and stores the cluster's rows
contiguously.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vecstore.cluster import CLUSTERERS, strided_init
from vecstore.config import StoreConfig
from vecstore.index.base import INDEXES, IndexView, Segment, UnitSummary
from vecstore.index.pages import sliced_group_softmax_rank

__all__ = ["WaveIndex", "bound_logits", "split_segments"]


def split_segments(num_tokens: int, segment_tokens: int) -> list[int]:
    """Near-equal segment lengths (differing by at most 1) covering ``num_tokens``."""
    count = max(1, math.ceil(num_tokens / segment_tokens))
    base, extra = divmod(num_tokens, count)
    return [base + 1] * extra + [base] * (count - extra)


@INDEXES.register("wave")
class WaveIndex:
    """Clusters keys with spherical k-means; ranks clusters by group-summed softmax.

    A cluster's ranking logit is ``q·c + w·|q|·r`` (centroid ``c``, radius ``r``,
    ``w = index.radius_weight``): at ``w = 1`` the Cauchy-Schwarz upper bound of its best
    member's score, so a cluster holding one outlying key that the query seeks is not
    buried under its mean; at ``w = 0`` the centroid score alone.

    Examples
    --------
    >>> idx = WaveIndex(StoreConfig.from_dict({"index": {"tokens_per_cluster": 4}}))
    >>> keys, values = torch.randn(2, 32, 8), torch.randn(2, 32, 8)
    >>> (seg,) = idx.build(keys, values, start=4)
    >>> seg.num_units, seg.meta["centroids"].shape
    (8, torch.Size([2, 8, 8]))
    >>> int(seg.offsets[0, -1])
    32
    """

    can_estimate = True
    is_exact = False

    def __init__(self, config: StoreConfig) -> None:
        self.config = config.index
        self.clusterer = CLUSTERERS.get(config.cluster.kind)(seed=config.cluster.seed)

    @property
    def radius_weight(self) -> float:
        """Weight of the cluster radius in the ranking logit (``index.radius_weight``)."""
        return self.config.radius_weight

    def build(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> list[Segment]:
        H, N, D = keys.shape
        lengths = split_segments(N, self.config.segment_tokens)
        n = lengths[0]
        k = math.ceil(n / self.config.tokens_per_cluster)
        S = len(lengths)
        # [H, N, D] -> padded problems [S * H, n, D], problem p = s * H + h
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        kf = keys.float()
        x = torch.zeros(S, H, n, D, device=keys.device)
        for s in range(S):
            x[s, :, : lengths[s]] = kf[:, bounds[s]:bounds[s + 1]]
        x = x.reshape(S * H, n, D)
        # [S*H]; staged without waiting for the device (a blocking copy would)
        counts = torch.tensor(lengths).repeat_interleave(H).to(keys.device, non_blocking=True)
        valid = torch.arange(n, device=keys.device)[None, :] < counts[:, None]
        mean = (x * valid[..., None]).sum(1, keepdim=True) / counts[:, None, None]
        unit = F.normalize(x - mean, dim=-1)
        init = strided_init(unit, counts, k)
        assign = self.clusterer.assign(unit, counts, init, self.config.kmeans_iters)
        assign = assign.to(keys.device).masked_fill(~valid, k)  # padding sorts last
        return [
            self._segment(keys[:, bounds[s]:bounds[s + 1]], values[:, bounds[s]:bounds[s + 1]],
                          assign.reshape(S, H, n)[s, :, : lengths[s]], k, start + bounds[s])
            for s in range(S)
        ]

    @staticmethod
    def _segment(keys: torch.Tensor, values: torch.Tensor, assign: torch.Tensor, k: int,
                 start: int) -> Segment:
        H, n, D = keys.shape
        order = torch.argsort(assign, dim=1, stable=True)  # [H, n]
        sizes = torch.zeros(H, k, dtype=torch.long, device=keys.device)
        sizes.scatter_add_(1, assign, torch.ones_like(assign))
        offsets = torch.cat([sizes.new_zeros(H, 1), sizes.cumsum(1)], dim=1)
        idx = order[..., None].expand(-1, -1, D)
        k_sorted, v_sorted = keys.gather(1, idx), values.gather(1, idx)
        # plain mean centroids and value sums, in the original key space
        members = assign[..., None].expand(-1, -1, D)
        key_sums = torch.zeros(H, k, D, device=keys.device).scatter_add_(1, members, keys.float())
        value_sums = torch.zeros(H, k, D, device=keys.device).scatter_add_(
            1, members, values.float())
        centroids = key_sums / sizes.clamp_min(1)[..., None]
        spread = (keys.float() - centroids.gather(1, members)).norm(dim=-1)  # [H, n]
        radii = torch.zeros(H, k, device=keys.device).scatter_reduce_(1, assign, spread, "amax")
        return Segment(start=start, end=start + n, keys=k_sorted, values=v_sorted,
                       offsets=offsets, meta={"centroids": centroids, "radii": radii,
                                              "value_sums": value_sums})

    def summarize(self, view: IndexView) -> UnitSummary:
        """The view's centroids, value sums and radii, and ``index.radius_weight``."""
        return UnitSummary(centroids=view.meta["centroids"], value_sums=view.meta["value_sums"],
                           radii=view.meta["radii"], radius_weight=self.radius_weight)

    def rank(self, view: IndexView, q: torch.Tensor, scale: float) -> torch.Tensor:
        centroids, radii, weight = view.meta["centroids"], view.meta["radii"], self.radius_weight
        return sliced_group_softmax_rank(
            lambda qs: bound_logits(qs, centroids, radii, scale, weight), q, view.sizes)


def bound_logits(q: torch.Tensor, centroids: torch.Tensor, radii: torch.Tensor, scale: float,
                 weight: float) -> torch.Tensor:
    """Ranking logits ``scale * (q·c + weight·|q|·r)``, ``[B, Hkv, G, L, C]``.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hkv, G, L, D]`` grouped queries.
    centroids, radii : torch.Tensor
        ``[B, Hkv, C, D]`` and ``[B, Hkv, C]``.
    """
    logits = torch.einsum("bhgld,bhcd->bhglc", q, centroids)
    if weight:  # in place: one [B, Hkv, G, L, C] tensor, not three
        logits.addcmul_(weight * q.norm(dim=-1, keepdim=True), radii[:, :, None, None, :])
    return logits.mul_(scale)
