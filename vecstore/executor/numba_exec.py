"""The CPU executor: the wave decode step fused into one Numba pass per layer.

A decode query (one token per sequence) over an estimating index, with KV in float32 or
bfloat16 on the CPU, runs :func:`vecstore.kernels.cpu_decode.decode_rows`: the ranking,
the zones and the three zones' attention in one parallel loop over (sequence, KV head)
rows, reading the retrieved clusters' rows where they are stored. The torch reference
(:class:`~vecstore.executor.torch_ref.TorchExecutor`) spends ~40 small operations a layer
on the same work, which dominates a CPU decode step at a few thousand tokens. Anything
else (prefill with ``L > 1``, exact layers, indexes that cannot estimate, float16 KV, KV
on another device) runs on the reference, whose plan this executor reproduces: the same
zones (ties broken by cluster id), the same merge, float32 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from vecstore.config import LayerConfig
from vecstore.executor.base import EXECUTORS, Steady
from vecstore.executor.plan import zone_sizes
from vecstore.executor.prepared_views import PreparedViews
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.index.base import EstimatingIndex, Index, IndexView
from vecstore.kernels.cpu_decode import decode_rows
from vecstore.types import QueryStats

__all__ = ["NumbaExecutor"]

# bfloat16 rows reach Numba as their bit patterns
_BITS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16}


@EXECUTORS.register("numba")
class NumbaExecutor:
    """Fused wave decode on the CPU (Numba); the torch reference for everything else.

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> from vecstore.index.wave import WaveIndex
    >>> idx = WaveIndex(StoreConfig())
    >>> view = IndexView.from_segments(idx.build(torch.randn(2, 64, 8), torch.randn(2, 64, 8), 0))
    >>> steady = Steady(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.tensor([3]))
    >>> layer = StoreConfig().for_layer(0)
    >>> q = torch.randn(1, 4, 1, 8)
    >>> out, lse, stats = NumbaExecutor().run(idx, view, steady, q, 0.35, layer)
    >>> ref = TorchExecutor().run(idx, view, steady, q, 0.35, layer)  # the same plan
    >>> torch.allclose(out, ref[0], atol=1e-5), stats.units_retrieved == ref[2].units_retrieved
    (True, True)
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.reference = TorchExecutor(device)
        self._prepared: PreparedViews[_Prepared] = PreparedViews()

    def can_run(self, index: Index, view: IndexView | None, q: torch.Tensor,
                layer: LayerConfig) -> bool:
        """Whether the fused step handles this query (else the reference runs)."""
        if view is None or q.shape[2] != 1 or layer.exact or index.is_exact:
            return False
        if not index.can_estimate or view.keys.dtype not in _BITS:
            return False
        return q.device.type == "cpu" and view.keys.device.type == "cpu"

    def run(
        self, index: Index, view: IndexView | None, steady: Steady, q: torch.Tensor,
        scale: float, layer: LayerConfig, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, QueryStats]:
        if not self.can_run(index, view, q, layer):
            return self.reference.run(index, view, steady, q, scale, layer, softcap)
        assert view is not None
        prep = self.prepare(view, layer, index)
        B, Hq, _, D = q.shape
        H = view.sizes.shape[1]
        s_keys, s_values, s_base = _row_table(steady.keys, steady.values)
        lengths = steady.lengths.numpy()
        out, lse, mass, counts = decode_rows(
            q.float().reshape(B * H, Hq // H, D).numpy(), prep.keys, prep.values, prep.base,
            prep.offsets, prep.sizes, prep.centroids, prep.radii, prep.value_sums,
            s_keys, s_values, s_base, np.repeat(lengths.astype(np.int64), H),
            prep.retrieve, prep.estimate, scale=scale, weight=prep.radius_weight,
            softcap=softcap)
        exact, retrieved, estimated = counts.sum(0).tolist()
        stats = QueryStats(
            tokens_total=round((int(lengths.sum()) * H + prep.stored) / H),
            tokens_exact=round(exact / H), units_retrieved=retrieved,
            units_estimated=estimated,
            estimated_mass=float(mass.sum(dtype=np.float64)) / (B * Hq) if estimated else 0.0)
        out_t = torch.from_numpy(out).reshape(B, Hq, 1, D).to(q.dtype)
        return out_t, torch.from_numpy(lse).reshape(B, Hq, 1), stats

    def prepare(self, view: IndexView, layer: LayerConfig, index: Index) -> _Prepared:
        """The arrays the step reads of ``view`` for ``layer``'s budgets, built once."""
        return self._prepared.get(
            view, layer, lambda: _Prepared.of(view, layer, cast(EstimatingIndex, index)))

    def release_view(self, view: IndexView) -> None:
        """Forget what was prepared for ``view`` (the store calls this when the view is
        replaced, dropped or closed)."""
        self._prepared.release(view)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A view as the step reads it: numpy arrays over its tensors (views where they can
    be), and each row's zone sizes."""

    view: IndexView
    keys: np.ndarray
    values: np.ndarray
    base: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    centroids: np.ndarray
    radii: np.ndarray
    value_sums: np.ndarray
    radius_weight: float
    retrieve: np.ndarray
    estimate: np.ndarray
    stored: int

    @staticmethod
    def of(view: IndexView, layer: LayerConfig, index: EstimatingIndex) -> _Prepared:
        summary = index.summarize(view)
        B, H, C = view.sizes.shape
        D = view.keys.shape[-1]
        zones = [zone_sizes(n, layer, index) for n in view.num_units.tolist()]
        keys, values, base = _row_table(view.keys, view.values)
        return _Prepared(
            view=view, keys=keys, values=values, base=base,
            offsets=_flat(view.offsets, B * H, C + 1), sizes=_flat(view.sizes, B * H, C),
            centroids=_flat(summary.centroids, B * H, C, D, dtype=torch.float32),
            radii=_flat(summary.radii, B * H, C, dtype=torch.float32),
            value_sums=_flat(summary.value_sums, B * H, C, D, dtype=torch.float32),
            radius_weight=summary.radius_weight,
            retrieve=np.repeat(np.array([z[0] for z in zones], np.int64), H),
            estimate=np.repeat(np.array([z[1] for z in zones], np.int64), H),
            stored=int(view.sizes.sum()))


def _flat(x: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> np.ndarray:
    """``x`` as a C-contiguous numpy array of ``shape`` (a view where it can be)."""
    if dtype is not None:
        x = x.to(dtype)
    return x.reshape(shape).contiguous().numpy()


def _row_table(keys: torch.Tensor, values: torch.Tensor,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[B, H, N, D]`` keys and values as ``[rows, D]`` tables over their storage (no
    copy where each (sequence, head)'s rows are contiguous and whole rows apart, as every
    tier and tail buffer keeps them), with the first row of each (sequence, head)."""
    B, H, N, D = keys.shape
    strides = keys.stride()
    sb, sh, sn, sd = strides
    if (values.stride() != strides or sd != 1 or sn != D or sb % D or sh % D
            or not keys.numel()):
        keys, values = keys.contiguous(), values.contiguous()
        sb, sh = H * N * D, N * D
    span = ((B - 1) * sb + (H - 1) * sh) // D + N  # first (sequence, head)'s row to the end
    bits = _BITS[keys.dtype]
    tables = [x.as_strided((span, D), (D, 1)).view(bits).numpy() for x in (keys, values)]
    rows = np.arange(B * H)
    return tables[0], tables[1], rows // H * (sb // D) + rows % H * (sh // D)
