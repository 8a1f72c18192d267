"""The wave executor: fused Triton decode over GPU-resident or offloaded KV (RetroInfer).

A decode step (one query token per sequence, ``B`` sequences at once) is the index probe
and the three zones' attention, merged (:func:`~vecstore.executor.wave_step.decode_step`);
on CUDA, :meth:`WaveExecutor.run` replays it as a CUDA graph captured per layer
(:mod:`vecstore.executor.wave_graph`). What a step needs of a view is prepared once per view
and budget (:func:`~vecstore.executor.wave_state.prepare_view`), from the units' summary its
index gives (:meth:`~vecstore.index.base.EstimatingIndex.summarize`).

KV rows that live in host memory (an :class:`~vecstore.index.base.IndexView` whose keys
are on the CPU while the query is on the GPU) go through a
:class:`~vecstore.buffer.WaveBuffer`: block cache, execution buffer, misses over PCIe.

Anything else (prefill with ``L > 1``, indexes that cannot estimate, exact layers, CPU tensors
without the Triton interpreter) runs on :class:`~vecstore.executor.torch_ref.TorchExecutor`,
whose plan this executor reproduces: same zones (ties broken by cluster id), same merge.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch

from vecstore.buffer.wave_buffer import BufferStats, WaveBuffer
from vecstore.config import LayerConfig, StoreConfig
from vecstore.errors import CapacityError, ConfigError
from vecstore.executor.base import EXECUTORS, Steady
from vecstore.executor.prepared_views import PreparedViews
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.executor.wave_graph import replay
from vecstore.executor.wave_state import DecodeResult, PreparedView, prepare_view, step_stats
from vecstore.executor.wave_step import decode_step
from vecstore.executor.wave_streams import StreamPool
from vecstore.index.base import EstimatingIndex, Index, IndexView
from vecstore.kernels.backend import Backend, is_interpreted, resolve_backend
from vecstore.kvstore.base import MemoryAccount
from vecstore.types import QueryStats

__all__ = ["WaveExecutor"]

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

    def __init__(self, device: str = "cpu", *, backend: Backend = "auto",
                 score_dtype: torch.dtype | None = torch.int8, cache_policy: str = "lru",
                 cache_capacity: float = 0.05, slot_tokens: int = 32,
                 simulate_offload: bool = False, use_graphs: bool = True,
                 accounts: Callable[[torch.device], MemoryAccount] | None = None) -> None:
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
        self.accounts = accounts
        self._streams = StreamPool()
        # one thread applies the block-cache policy records of every offloaded layer (a
        # thread per layer's buffer kept 32 threads contending for the GIL with the decode
        # loop of a 32-layer model); it starts with the first record
        self._policy_worker = ThreadPoolExecutor(1, thread_name_prefix="vecstore-policy")
        self.reference = TorchExecutor(device)
        self._prepared: PreparedViews[PreparedView] = PreparedViews(on_drop=_close_buffer)
        # block caches handed to views that succeed the ones they served (hand_over), by
        # the successor's id, until it is prepared (they move into its buffer) or released
        self._heirs: dict[int, tuple[IndexView, WaveBuffer]] = {}
        self._resolved: dict[tuple[str, torch.device, bool], str] = {}

    @classmethod
    def from_config(cls, config: StoreConfig,
                    accounts: Callable[[torch.device], MemoryAccount] | None = None,
                    ) -> WaveExecutor:
        """The executor a store of ``config`` uses: ``executor.device``, the block
        cache's ``cache.policy`` and ``cache.capacity``, and the store's GPU ``accounts``."""
        return cls(config.executor.device, cache_policy=config.cache.policy,
                   cache_capacity=config.cache.capacity, accounts=accounts)

    # -- Executor protocol ---------------------------------------------------------------
    def run(
        self, index: Index, view: IndexView | None, steady: Steady, q: torch.Tensor,
        scale: float, layer: LayerConfig, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, QueryStats]:
        if not self.can_run(index, view, q, layer):
            return self.reference.run(index, view, steady, q, scale, layer, softcap)
        assert view is not None
        prep = self.prepare(view, layer, index)
        B = q.shape[0]
        if self.use_graphs and q.device.type == "cuda":
            res = replay(prep, steady, q[:, :, 0], scale, self.decode, softcap)
            assert prep.graph is not None and prep.graph.stats is not None
            values = prep.graph.stats.clone()
        else:
            if prep.buffer is not None:
                prep.buffer.begin_step()
            res = self.decode(prep, steady, q[:, :, 0].contiguous(), scale, softcap)
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
        if not index.can_estimate:  # an EstimatingIndex: its units have centroids
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
        """Build (or fetch) the decode-ready form of ``view`` for ``layer``'s budgets; an
        offloaded view handed a block cache (:meth:`hand_over`) takes it over."""
        def build() -> PreparedView:
            heir = self._take_heir(view)
            try:
                return prepare_view(
                    view, cast(EstimatingIndex, index).summarize(view), layer, index,
                    score_dtype=self.score_dtype, offload=self.simulate_offload,
                    cache_policy=self.cache_policy, cache_capacity=self.cache_capacity,
                    slot_tokens=self.slot_tokens, accounts=self.accounts,
                    policy_worker=self._policy_worker, predecessor=heir)
            except CapacityError:
                if heir is None:
                    raise
                heir.close()  # no room for both caches at once: start anew
                heir = None
                return build()
            finally:
                if heir is not None:
                    heir.close()

        return self._prepared.get(view, layer, build)

    def hand_over(self, old: IndexView, new: IndexView) -> None:
        """``new`` replaced ``old`` by appending units to it (a segment flush): the block
        cache prepared for ``old`` is kept for ``new``, whose buffer takes it over when
        ``new`` is prepared (the clusters it held stay cached, nothing crosses PCIe again)
        instead of being freed with ``old`` (the store calls this before
        :meth:`release_view` of ``old``)."""
        buffer = self._take_heir(old)  # old was itself handed one, never prepared
        for prep in self._prepared.values():
            if prep.view is old and prep.buffer is not None and buffer is None:
                buffer, prep.buffer = prep.buffer, None
        if buffer is None:
            return
        stale = self._heirs.pop(id(new), None)
        if stale is not None:
            stale[1].close()
        self._heirs[id(new)] = (new, buffer)

    def _take_heir(self, view: IndexView) -> WaveBuffer | None:
        """The block cache handed to ``view``, now the caller's, or ``None``."""
        heir = self._heirs.pop(id(view), None)
        return heir[1] if heir is not None and heir[0] is view else None

    def buffer_stats(self) -> BufferStats:
        """The block caches' hits and misses so far, summed over the views this executor
        serves from host memory (all zero when none is; synchronises with the device).

        Examples
        --------
        >>> WaveExecutor("cpu").buffer_stats().hit_rate  # nothing offloaded yet
        0.0
        """
        total = BufferStats(0, 0, 0, 0)
        for prep in self._prepared.values():
            if prep.buffer is not None:
                total = total + prep.buffer.stats
        return total

    def release_view(self, view: IndexView) -> None:
        """Forget what was prepared for ``view`` and close its wave buffer, and a buffer
        handed to it (the store calls this when the view is replaced, dropped or closed)."""
        self._prepared.release(view)
        heir = self._take_heir(view)
        if heir is not None:
            heir.close()

    # -- the step ------------------------------------------------------------------------
    def decode(self, prep: PreparedView, steady: Steady, q: torch.Tensor,
               scale: float, softcap: float | None = None,
               steady_ready: torch.cuda.Event | None = None) -> DecodeResult:
        """One decode step: ``q [B, Hq, D]`` against the view and the steady zone, every
        zone's scores soft-capped by ``softcap`` (``None``: no cap), the steady zone read
        once ``steady_ready`` (if given) has passed
        (:func:`~vecstore.executor.wave_step.decode_step`, on this executor's streams)."""
        return decode_step(prep, steady, q, scale, self._streams, softcap, steady_ready)


def _close_buffer(prep: PreparedView) -> None:
    """Free the wave buffer of a prepared view the executor no longer keeps."""
    if prep.buffer is not None:
        prep.buffer.close()
