"""The decode step of a model with a :class:`~benchmarks.full_attention.FullCache`, captured
whole (every layer, the model's forward) in one CUDA graph and replayed each step.

:class:`DecodeGraph` runs the step on static buffers: the step's token ids, and the slot
it writes (one device scalar, shared by the rows: left padding shifts where a row
starts, not where it writes). Everything else a step needs -- each row's RoPE position
(slot minus the row's start) and the lengths flash attention reads -- is computed from
those on the device, inside the step, so one capture serves every step until the cache is
full. Before each replay the host copies the new token ids in (device to device) and
fills the slot (a kernel with the value as its argument): no host sync, nothing read back.

On CUDA the step is warmed up on a side stream (kernels' first calls, the allocator's
pools) and captured on the first call; each warm-up run writes the same KV at the same
slot as the captured step will, so it changes nothing. Without CUDA the same static-buffer
step runs eagerly, so CPU tests cover all of it but the capture itself.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import PreTrainedModel

from benchmarks.full_attention import FullCache
from integrations.hf.cache import cache_kwarg
from integrations.hf.layer_compile import CompiledLayers
from vecstore.errors import ShapeError

__all__ = ["DecodeGraph"]

WARMUP_RUNS = 2  # eager runs on a side stream before the capture


class DecodeGraph:
    """One decode step of ``model`` with ``cache`` for a fixed batch, as a CUDA graph.

    Parameters
    ----------
    model : PreTrainedModel
        The model ``cache`` was created for.
    cache : FullCache
        Prefilled (eagerly, through the model) before the first step.
    capture : bool, optional
        Capture and replay a CUDA graph (default: when the cache is on CUDA); ``False``
        runs the same static step eagerly.
    num_splits : int
        How many parts flash attention splits each row's keys into (0: its own choice);
        fixed in the graph at capture. Several graphs of different splits may take turns
        on one cache.
    compile_layers : bool
        Run the step with the decoder layers compiled around their attention
        (:class:`~integrations.hf.layer_compile.CompiledLayers`, as a
        ``WaveCache(compile_layers=True)`` runs its steps).
    """

    def __init__(self, model: PreTrainedModel, cache: FullCache, *,
                 capture: bool | None = None, num_splits: int = 0,
                 compile_layers: bool = False) -> None:
        self.model, self.cache, self.num_splits = model, cache, num_splits
        self.compiled = CompiledLayers(model) if compile_layers else None
        self.capture = cache.device.type == "cuda" if capture is None else capture
        self.ids = torch.zeros(cache.batch, 1, dtype=torch.long, device=cache.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=cache.device)
        self._kwarg = cache_kwarg(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode the next token of every row: ``ids [B, 1]`` in, ``logits [B, 1, V]`` out
        (on CUDA the graph's output buffer: read it before the next call)."""
        if ids.shape != self.ids.shape:
            raise ShapeError(f"ids: this step decodes {tuple(self.ids.shape)} token ids "
                             f"([batch, 1]), got {tuple(ids.shape)}")
        seen = self.cache.get_seq_length()
        self.cache.check_room(seen, 1)
        self.ids.copy_(ids)
        self.slot.fill_(seen)
        if not self.capture:
            logits = self._step()
        else:
            if self.graph is None:
                self._capture()
            assert self.graph is not None and self.logits is not None
            self.graph.replay()
            logits = self.logits
        self.cache.advance(1)
        return logits

    def _step(self) -> torch.Tensor:
        """The step on the static buffers (what the graph holds)."""
        cache = self.cache
        positions = self.slot - cache.start[:, None]  # [B, 1]: each row's RoPE position
        cache.static_slots, cache.num_splits = self.slot, self.num_splits
        try:
            with self.compiled.active() if self.compiled is not None else nullcontext():
                out = self.model(input_ids=self.ids, position_ids=positions, use_cache=True,
                                 logits_to_keep=1, **{self._kwarg: cache})
        finally:
            cache.static_slots, cache.num_splits = None, 0
        return out.logits

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call of another thread (a store's bookkeeping worker) during
        # the capture neither fails nor spoils it; this thread's calls are still checked
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._step()
        self.graph = graph
