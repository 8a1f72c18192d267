"""The wave executor: fused Triton decode over GPU-resident or offloaded KV (RetroInfer).

A decode step (one query token per sequence, ``B`` sequences at once, no Python loop over
sequences or heads):

1. centroid logits, the GQA-summed softmax score of every cluster, and the retrieval and
   estimation zones by radix select, without sorting
   (:func:`~vecstore.executor.wave_select.centroid_logits`,
   :func:`~vecstore.executor.wave_select.select_ranked`);
2. split-K attention over the retrieved rows, and on a side stream the steady zone and the
   estimated clusters, merged by log-sum-exp (:mod:`vecstore.executor.wave_kernels`).

On CUDA, :meth:`WaveExecutor.run` replays the step as a CUDA graph captured per layer.

KV rows that live in host memory (an :class:`~vecstore.index.base.IndexView` whose keys
are on the CPU while the query is on the GPU) go through a
:class:`~vecstore.buffer.WaveBuffer`: block cache, execution buffer, misses over PCIe.

Anything else (prefill with ``L > 1``, indexes without centroids, exact layers, CPU tensors
without the Triton interpreter) runs on :class:`~vecstore.executor.torch_ref.TorchExecutor`,
whose plan this executor reproduces: same zones (ties broken by cluster id), same merge.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from vecstore.buffer.wave_buffer import WaveBuffer
from vecstore.config import LayerConfig, StoreConfig
from vecstore.errors import ConfigError
from vecstore.executor.base import EXECUTORS, Steady
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.executor.wave_state import (
    CapturedStep,
    DecodeResult,
    PreparedView,
    Zones,
    prepare_view,
    step_stats,
)
from vecstore.executor.wave_streams import StreamPool, on, pipeline_groups
from vecstore.index.base import Index, IndexView
from vecstore.kernels._backend import is_interpreted, resolve_backend
from vecstore.kernels.step_stats import accumulate_step
from vecstore.types import QueryStats

__all__ = ["WaveExecutor", "PreparedView", "DecodeResult", "Zones"]

_MAX_PREPARED = 512
_SCORE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.int8)


@EXECUTORS.register("wave")
class WaveExecutor:
    """Fused decode attention over the wave index; the torch reference for everything else.

    Parameters
    ----------
    device : str
        The executor's device (``cuda`` for the kernels).
    backend : {"auto", "triton", "torch"}
        ``auto`` runs the kernels on CUDA tensors; ``triton`` also runs them on CPU tensors
        under ``TRITON_INTERPRET=1`` (tests); ``torch`` always uses the reference.
    score_dtype : torch.dtype or None
        Dtype of the centroids used for scoring. ``torch.int8`` (default): int8 codes with a
        scale per centroid (:mod:`~vecstore.executor.sq8`), a quarter of the bytes of
        float32 (on the H200, 8 x 512K to 8 x 1M steps 6-8 % faster than bfloat16 centroids,
        the same error against exact attention). ``None``: the KV dtype. ``torch.float32``
        ranks exactly as the reference does.
    cache_policy : str
        Replacement policy of the block cache of offloaded views.
    cache_capacity : float
        Cache slots as a fraction of a layer's clusters.
    slot_tokens : int
        Rows per cache slot; clusters larger than this are not cached.
    simulate_offload : bool
        Serve every view through the block cache even when its rows share the device
        (how the tests exercise the buffer on CPU tensors).
    use_graphs : bool
        On CUDA, run each step as a CUDA graph captured per layer, query shape and steady
        capacity (the launches of a step cost more than its GPU time otherwise).

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> from vecstore.index.wave import WaveIndex
    >>> idx = WaveIndex(StoreConfig())
    >>> view = IndexView.from_segments(idx.build(torch.randn(2, 64, 8), torch.randn(2, 64, 8), 0))
    >>> steady = Steady(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.tensor([3]))
    >>> q = torch.randn(1, 4, 1, 8)
    >>> out, lse, stats = WaveExecutor().run(idx, view, steady, q, 0.35, StoreConfig().for_layer(0))
    >>> out.shape  # CPU tensors without TRITON_INTERPRET: the torch reference ran
    torch.Size([1, 4, 1, 8])
    """

    def __init__(self, device: str = "cpu", *, backend: str = "auto",
                 score_dtype: torch.dtype | None = torch.int8, cache_policy: str = "lru",
                 cache_capacity: float = 0.05, slot_tokens: int = 32,
                 simulate_offload: bool = False, use_graphs: bool = True) -> None:
        if score_dtype not in _SCORE_DTYPES:
            raise ConfigError(f"score_dtype must be one of "
                              f"{', '.join(str(d) for d in _SCORE_DTYPES[1:])} or None, "
                              f"got {score_dtype!r}")
        self.device = device
        self.backend = backend
        self.score_dtype = score_dtype
        self.cache_policy = cache_policy
        self.cache_capacity = cache_capacity
        self.slot_tokens = slot_tokens
        self.simulate_offload = simulate_offload
        self.use_graphs = use_graphs
        self._streams = StreamPool()
        self.reference = TorchExecutor(device)
        self._prepared: OrderedDict[tuple[int, float, float], PreparedView] = OrderedDict()
        self._resolved: dict[tuple[str, torch.device, bool], str] = {}

    @classmethod
    def from_config(cls, config: StoreConfig) -> WaveExecutor:
        """The executor a store of ``config`` uses: ``executor.device``, and the block
        cache's ``cache.policy`` and ``cache.capacity``."""
        return cls(config.executor.device, cache_policy=config.cache.policy,
                   cache_capacity=config.cache.capacity)

    # -- Executor protocol ---------------------------------------------------------------
    def run(
        self, index: Index, view: IndexView | None, steady: Steady, q: torch.Tensor,
        scale: float, layer: LayerConfig,
    ) -> tuple[torch.Tensor, torch.Tensor, QueryStats]:
        if not self.can_run(index, view, q, layer):
            return self.reference.run(index, view, steady, q, scale, layer)
        assert view is not None
        prep = self.prepare(view, layer, index)
        B, Hq, _, D = q.shape
        if self.use_graphs and q.device.type == "cuda":
            res = self._replay(prep, steady, q[:, :, 0], scale)
            assert prep.graph is not None and prep.graph.stats is not None
            values = prep.graph.stats.clone()
        else:
            if prep.buffer is not None:
                prep.buffer.begin_step()
            res = self.decode(prep, steady, q[:, :, 0].contiguous(), scale)
            if prep.buffer is not None:
                prep.buffer.finish_step()
            values = step_stats(res, steady.lengths, prep.tokens_total, prep.sizes.shape[0] // B)
        # read back only when someone reads the stats: the step never waits for the device
        stats = QueryStats.deferred(values)
        # clones: a graph's outputs are overwritten by its next replay
        return res.out[:, :, None].clone(), res.lse[:, :, None].clone(), stats

    def can_run(self, index: Index, view: IndexView | None, q: torch.Tensor,
                layer: LayerConfig) -> bool:
        """Whether the fused decode handles this query (else the reference runs)."""
        if view is None or q.shape[2] != 1 or layer.exact or index.is_exact:
            return False
        if not index.can_estimate or "centroids" not in view.meta:
            return False
        D = q.shape[-1]
        if D < 16 or D & (D - 1):  # the kernels tile head_dim as one power-of-two block
            return False
        if self.backend == "torch":
            return False
        key = (self.backend, q.device, is_interpreted())
        resolved = self._resolved.get(key)
        if resolved is None:
            resolved = self._resolved[key] = resolve_backend(self.backend, q.device)
        return resolved == "triton"

    # -- preparation ---------------------------------------------------------------------
    def prepare(self, view: IndexView, layer: LayerConfig, index: Index) -> PreparedView:
        """Build (or fetch) the decode-ready form of ``view`` for ``layer``'s budgets."""
        key = (id(view), layer.retrieval_budget, layer.estimation_budget)
        prep = self._prepared.get(key)
        if prep is not None and prep.view is view:
            self._prepared.move_to_end(key)
            return prep
        prep = prepare_view(view, layer, index, score_dtype=self.score_dtype,
                            offload=self.simulate_offload, cache_policy=self.cache_policy,
                            cache_capacity=self.cache_capacity, slot_tokens=self.slot_tokens)
        self._prepared[key] = prep
        while len(self._prepared) > _MAX_PREPARED:
            _, old = self._prepared.popitem(last=False)
            if old.buffer is not None:
                old.buffer.close()
        return prep

    def release_view(self, view: IndexView) -> None:
        """Forget what was prepared for ``view`` and close its wave buffer (the store calls
        this when the view is replaced, dropped or closed)."""
        for key in [k for k, p in self._prepared.items() if p.view is view]:
            prep = self._prepared.pop(key)
            if prep.buffer is not None:
                prep.buffer.close()

    # -- the step ------------------------------------------------------------------------
    def decode(self, prep: PreparedView, steady: Steady, q: torch.Tensor,
               scale: float) -> DecodeResult:
        """One decode step: ``q [B, Hq, D]`` against the view and the steady zone.

        Only device work of fixed shapes for fixed inputs (the steady capacity included),
        so the whole call can be captured in a CUDA graph; an offloaded view's
        :meth:`WaveBuffer.begin_step`/`finish_step` run outside it. A graph capturing it
        reads ``prep``'s tensors: keep ``prep`` alive as long as the graph.

        On CUDA the rows are served in
        :func:`~vecstore.executor.wave_streams.pipeline_groups` groups: the current stream
        computes every group's centroid logits one after the other (bandwidth-bound), and
        each group's selection (latency-bound) and attention run on a stream of their own
        as soon as its logits are written, next to the following groups' logits. In a
        group, a side stream attends the estimated zone next to the retrieved one (they
        read different bytes); the first group's side stream also attends the steady zone
        next to its selection.
        """
        # triton is imported here, not at module import: it is an optional dependency
        from vecstore.executor.wave_kernels import (
            attend_estimated,
            attend_retrieved,
            attend_steady,
            combine,
            estimate_layout,
            fill_rowmap,
            retrieved_layout,
            steady_splits,
        )
        from vecstore.executor.wave_select import centroid_logits, select_ranked

        B, Hq, D = q.shape
        rows, C = prep.sizes.shape
        G = B * Hq // rows
        dev = q.device
        buf = prep.buffer
        _, n_ret = retrieved_layout(prep.max_rows)
        main = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        if buf is not None:
            n_ret *= 2  # the hits and the misses of the execution buffer apart
        n_std = steady_splits(steady.keys.shape[2])
        _, n_est = estimate_layout(prep.e_max)
        P = n_ret + n_std + n_est
        parts = (torch.empty(B * Hq, P, D, dtype=torch.float32, device=dev),
                 torch.empty(B * Hq, P, dtype=torch.float32, device=dev))
        qf = q.reshape(B * Hq, D).contiguous()
        qs = qf if prep.code_scales is not None else qf.to(prep.centroids.dtype)
        cent = prep.centroids.view(rows, C, D)
        weights = torch.empty(B * Hq, C, dtype=torch.float32, device=dev)
        zones = Zones.empty(rows, C, prep.r_max, dev, prep.e_max)
        out = torch.empty(B * Hq, D, dtype=q.dtype, device=dev)
        lse = torch.empty(B * Hq, dtype=torch.float32, device=dev)
        groups = 1 if buf is not None else pipeline_groups(rows, C)
        steady_done = torch.cuda.Event() if main is not None else None
        joins = []
        for g in range(groups):
            r0, r1 = g * rows // groups, (g + 1) * rows // groups
            x0, x1 = r0 * G, r1 * G
            radii = prep.radii[r0:r1] if prep.radii is not None else None
            scales = prep.code_scales[r0:r1] if prep.code_scales is not None else None
            logits = centroid_logits(qs[x0:x1], cent[r0:r1], radii, prep.sizes[r0:r1], scale,
                                     prep.radius_weight, weights[x0:x1], scales)
            sel, side = self._streams.get(dev, "select", g), self._streams.get(dev, "side", g)
            if sel is not None:
                sel.wait_stream(main)  # this group's logits; the next group's follow on main
                joins.append(sel)
            part = (parts[0][x0:x1], parts[1][x0:x1])
            z = zones.rows(r0, r1)
            with on(sel):
                if g == 0:  # the steady zone's reads overlap the first group's selection
                    if side is not None:
                        side.wait_stream(sel)
                    with on(side):
                        attend_steady(qf, steady.keys, steady.values, steady.lengths, scale,
                                      parts, n_ret)
                        if steady_done is not None:
                            steady_done.record()
                select_ranked(logits, prep.sizes[r0:r1], prep.first_row[r0:r1],
                              prep.k1[r0:r1], prep.k2[r0:r1], z)
                if side is not None:
                    side.wait_stream(sel)  # the estimated zone reads other bytes than retrieved
                with on(side):
                    attend_estimated(weights[x0:x1], prep.vmean[r0:r1], z, part, n_ret + n_std)
                if buf is None:
                    rowmap = torch.empty(r1 - r0, prep.max_rows, dtype=torch.int32, device=dev)
                    fill_rowmap(z, rowmap)
                    attend_retrieved(qf[x0:x1], prep.keys[r0:r1], prep.values[r0:r1], z, rowmap,
                                     scale, part, 0)
                else:
                    admit = self._attend_offloaded(buf, z, qf[x0:x1], scale, part)
                    if admit is not None:
                        joins.append(admit)
                if sel is not None:
                    sel.wait_stream(side)
                    sel.wait_event(steady_done)
                combine(part, out[x0:x1], lse[x0:x1])
        for stream in joins:
            main.wait_stream(stream)
        return DecodeResult(out=out.view(B, Hq, D), lse=lse.view(B, Hq), zones=zones,
                            parts_lse=parts[1], num_exact_parts=n_ret + n_std)

    def _attend_offloaded(self, buf: WaveBuffer, zones: Zones, q: torch.Tensor, scale: float,
                          parts: tuple[torch.Tensor, torch.Tensor]) -> torch.cuda.Stream | None:
        """The retrieved zone of an offloaded view, on the current stream: the block cache's
        lookup, hits and misses copied into the execution buffer, attention over the hits
        while the misses cross PCIe, then over the misses. The admission runs on a stream of
        its own: its bookkeeping (it reads the lookup, and hits never lose their slots) while
        the hits and misses are copied, its copy of the admitted rows into the cache after
        the attention over the misses, beside the merge (the caller joins the stream)."""
        from vecstore.executor.wave_kernels import attend_retrieved, retrieved_layout

        current = torch.cuda.current_stream(q.device) if q.device.type == "cuda" else None
        admit = self._streams.get(q.device, "admit")
        buf.lookup(zones)
        if admit is not None:
            admit.wait_stream(current)
        with on(admit):
            buf.plan_admission()
        buf.fill_misses()
        buf.fill_hits()
        split = buf.layout.split
        attend_retrieved(q, buf.exec_k, buf.exec_v, zones, None, scale, parts, 0, split=split)
        buf.wait_misses()
        attend_retrieved(q, buf.exec_k, buf.exec_v, zones, None, scale, parts,
                         retrieved_layout(buf.exec_k.shape[1])[1], split=split,
                         after_split=True)
        if admit is not None:
            admit.wait_stream(current)  # the misses have arrived
        with on(admit):
            buf.admit()
        return admit

    def _replay(self, prep: PreparedView, steady: Steady, q: torch.Tensor,
                scale: float) -> DecodeResult:
        """Run :meth:`decode` as a CUDA graph, captured once per query shape and steady
        zone: a ``persistent`` steady zone is read in place (captured per buffer), any other
        is copied into the graph's own, of a capacity rounded up to 256 rows (so a growing
        steady zone re-captures rarely)."""
        B, H, S, D = steady.keys.shape
        if steady.persistent:
            where: tuple = (steady.keys.data_ptr(), steady.values.data_ptr(),
                            steady.lengths.data_ptr(), S)
        else:
            where = (-(-S // 256) * 256,)
        key = (tuple(q.shape), q.dtype, where, scale)
        g = prep.graph
        if g is None or g.key != key:
            prep.graph = None  # free the old graph's memory before capturing
            g = prep.graph = self._capture(prep, key, q, steady, where, scale)
        g.q.copy_(q)
        if g.steady.keys is not steady.keys:
            g.steady.keys[:, :, :S].copy_(steady.keys)
            g.steady.values[:, :, :S].copy_(steady.values)
        if g.steady.lengths is not steady.lengths:
            g.steady.lengths.copy_(steady.lengths)
        if prep.buffer is not None:
            prep.buffer.begin_step()
        g.graph.replay()
        if prep.buffer is not None:
            prep.buffer.finish_step()
        return g.res

    def _capture(self, prep: PreparedView, key: tuple, q: torch.Tensor, steady: Steady,
                 where: tuple, scale: float) -> CapturedStep:
        B, H, S, D = steady.keys.shape
        if steady.persistent:  # read in place; the graph keeps the buffer alive
            static = steady
        else:
            cap = where[0]
            static = Steady(steady.keys.new_zeros(B, H, cap, D),
                            steady.values.new_zeros(B, H, cap, D), steady.lengths.clone())
            static.keys[:, :, :S].copy_(steady.keys)
            static.values[:, :, :S].copy_(steady.values)
        qs = q.contiguous().clone()
        warm = torch.cuda.Stream(q.device)
        warm.wait_stream(torch.cuda.current_stream(q.device))
        H = prep.sizes.shape[0] // B
        with torch.cuda.stream(warm):  # compiles the kernels; a real step for the buffer
            if prep.buffer is not None:
                prep.buffer.begin_step()
            res = self.decode(prep, static, qs, scale)
            _graph_stats(res, static, prep.tokens_total, H)
            if prep.buffer is not None:
                prep.buffer.finish_step()
        torch.cuda.current_stream(q.device).wait_stream(warm)
        if prep.buffer is not None:
            prep.buffer.bookkeeper.wait()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the policy worker may touch CUDA (events, pinned copies) meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            res = self.decode(prep, static, qs, scale)
            stats = _graph_stats(res, static, prep.tokens_total, H)
        return CapturedStep(key=key, graph=graph, q=qs, steady=static, res=res, stats=stats)


def _graph_stats(res: DecodeResult, steady: Steady, indexed: int, H: int) -> torch.Tensor:
    """:func:`step_stats` in two launches (a zeroed accumulator and one Triton kernel) for
    a captured step, instead of some twenty small ones."""
    stats = torch.zeros(5, dtype=torch.float64, device=res.lse.device)
    z = res.zones
    accumulate_step(z.cum, z.count, z.est_count, res.parts_lse, res.num_exact_parts, res.lse,
                    steady.lengths, indexed, H, stats)
    return stats
