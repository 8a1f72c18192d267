"""A WaveCache's decode steps as one CUDA graph of the model's whole forward.

:class:`DecodeGraph` stands in for the model's ``forward`` while a
:class:`~integrations.hf.cache.WaveCache` with ``cuda_graphs`` is open. A decode step with
that cache (one new token per row) runs the forward over static input buffers with every
attention layer routed to the batch's :class:`~vecstore.engine.decoder.BatchDecoder`: device work
of fixed shapes, so after its first run the forward is captured once and then replayed,
one launch per step for the whole model. What the graph cannot hold runs the model's
forward as it is (an "ordinary" step): prefills, the first decode step after a prefill
(it seals the prompt), the step whose token makes the tails index a segment (every
``attention.update_tokens`` tokens; the next step captures again), and batches the
decoder does not serve (see :meth:`vecstore.engine.store.Store.decoder`).

On a CPU the same fixed-shape steps run without capture (how the tests exercise them).
With :class:`~integrations.hf.layer_compile.CompiledLayers` the fixed-shape steps run the
model's decoder layers compiled around their attention (``WaveCache(compile_layers=True)``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from integrations.hf.cache_arg import cache_kwarg
from integrations.hf.layer_compile import CompiledLayers
from vecstore.engine.decoder import BatchDecoder
from vecstore.engine.sequence import Sequence
from vecstore.engine.tail import writing
from vecstore.errors import InvalidValueError

__all__ = ["DecodeGraph", "GraphedCache", "graphed_forward"]


class GraphedCache(Protocol):
    """What a :class:`DecodeGraph` asks of the cache whose steps it serves (a
    :class:`~integrations.hf.cache.WaveCache`)."""

    model: torch.nn.Module
    layers: list[Any]  # each counts the positions it has seen in ``seen``

    @property
    def sequences(self) -> list[Sequence]:
        """The store sequences of the batch rows."""

    @property
    def is_closed(self) -> bool:
        """Whether the cache was closed."""

    def decoder(self, batch: int) -> BatchDecoder | None:
        """The batch's fixed-shape decode steps, or ``None``."""

    def route(self, decoder: BatchDecoder | None) -> None:
        """Send the attention calls to ``decoder`` (``None``: through the store)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions seen so far."""

_STATIC_INPUTS = ("input_ids", "position_ids", "cache_position")
_CACHE_KWARGS = ("cache", "past_key_values")


@dataclass(eq=False, slots=True)
class _Captured:
    """One captured forward: the key it was captured for, its graph and its buffers."""

    key: tuple
    graph: torch.cuda.CUDAGraph | None  # None on a CPU: the step runs uncaptured
    inputs: dict[str, torch.Tensor]
    output: Any


class DecodeGraph:
    """The forward of ``model`` for ``cache``'s decode steps (see the module docstring).

    Parameters
    ----------
    cache : GraphedCache
        The cache whose steps it serves (a :class:`~integrations.hf.cache.WaveCache`);
        other forward calls go to ``forward`` unchanged.
    forward : callable
        The model's ``forward`` it wraps.
    previous : callable, optional
        What the model's instance held as ``forward`` before (``None``: the class's),
        restored when the graph is taken out.
    compiled : CompiledLayers, optional
        The model's layers compiled around their attention, run by the fixed-shape steps
        (``None``: the layers as they are).
    """

    def __init__(self, cache: GraphedCache, forward: Callable[..., Any],
                 previous: Callable[..., Any] | None = None,
                 compiled: CompiledLayers | None = None) -> None:
        self.cache = cache
        self.forward = forward
        self.previous = previous
        self.compiled = compiled
        self.decoder: BatchDecoder | None = None
        self._captured: _Captured | None = None
        self.static_steps = 0  # decode steps run as fixed-shape steps (replayed on CUDA)
        self.captures = 0
        functools.update_wrapper(self, forward, updated=())
        self._signature = inspect.signature(forward)
        self._cache_name = cache_kwarg(cache.model)  # before the graph stands in

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:  # named, as the model's forward names them
            kwargs = {**self._signature.bind_partial(*args).arguments, **kwargs}
        if not self._is_decode_step(kwargs):
            return self.forward(**kwargs)
        dec = self.decoder
        if dec is None or not dec.is_current():
            return self._ordinary(kwargs)
        if dec.flush_due:  # the decoder's last steps are checked before it goes
            self._begin(dec, wait=True)
            return self._ordinary(kwargs)
        self._begin(dec)
        key = self._key(kwargs)
        cap = self._captured
        if cap is None or cap.key != key:
            return self._first_run(key, kwargs)
        self._load(cap, kwargs)
        if cap.graph is not None:
            cap.graph.replay()
            for layer in self.cache.layers:
                layer.seen += 1
        else:
            cap.output = self._run_static(cap.inputs, cap.key)
        self._after_step()
        return _with_logits(cap.output, cap.output.logits.clone())

    def forget(self) -> None:
        """Drop the decoder and the captured step (the next step is an ordinary one)."""
        self.decoder, self._captured = None, None

    # -- the steps ---------------------------------------------------------------------
    def _is_decode_step(self, kwargs: dict[str, Any]) -> bool:
        ids = kwargs.get("input_ids")
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        return (cache is self.cache and isinstance(ids, torch.Tensor) and ids.dim() == 2
                and ids.shape[1] == 1 and kwargs.get("inputs_embeds") is None
                and self.cache.sequences != [] and not self.cache.is_closed)

    def _begin(self, dec: BatchDecoder, *, wait: bool = False) -> None:
        """Start a step (``wait``: only check the steps so far, waiting for the device);
        when an earlier one is found to have stored a NaN/Inf, the decoder drops its
        tokens and raises: the layers forget them too."""
        tokens = dec.tail_tokens
        try:
            if wait:
                dec.check(wait=True)
            else:
                dec.begin()
        except InvalidValueError:
            for layer in self.cache.layers:
                layer.seen -= tokens - dec.tail_tokens
            self.forget()
            raise

    def _ordinary(self, kwargs: dict[str, Any]) -> Any:
        """The model's forward as it is; then a decoder for the next steps, if the batch
        qualifies."""
        self._captured = None
        out = self.forward(**kwargs)
        self.decoder = self.cache.decoder(kwargs["input_ids"].shape[0])
        return out

    def _first_run(self, key: tuple, kwargs: dict[str, Any]) -> Any:
        """The first step of a new shape: run it uncaptured (compiling the kernels; it is
        a real step), then capture the forward for the next ones (capturing runs
        nothing)."""
        self._captured = None
        inputs = {name: t.clone() for name, t in kwargs.items() if name in _STATIC_INPUTS
                  and isinstance(t, torch.Tensor)}
        if "position_ids" not in inputs:
            inputs["position_ids"] = self._positions(kwargs["input_ids"])
        out = self._run_static(inputs, key)
        self._after_step()
        cap = _Captured(key, None, inputs, None)
        if inputs["input_ids"].device.type == "cuda":
            seen = [layer.seen for layer in self.cache.layers]
            graph = torch.cuda.CUDAGraph()
            # thread_local: an offloaded layer's policy worker may use CUDA meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                cap.output = self._run_static(inputs, key)
            for layer, count in zip(self.cache.layers, seen, strict=True):
                layer.seen = count  # capturing ran the forward's Python, not a step
            cap.graph = graph
            self.captures += 1
        self._captured = cap
        return out

    def _run_static(self, inputs: dict[str, torch.Tensor], key: tuple) -> Any:
        """The forward over the static ``inputs``, attention through the decoder."""
        assert self.decoder is not None
        other = dict(key[1])
        self.cache.route(self.decoder)
        try:
            with self.compiled.active() if self.compiled is not None else nullcontext():
                out = self.forward(**inputs, **other, attention_mask=None,
                                   **{self._cache_name: self.cache})
            self.decoder.end()
        finally:
            self.cache.route(None)
        return out

    def _after_step(self) -> None:
        assert self.decoder is not None
        self.decoder.advance()
        self.static_steps += 1

    def _load(self, cap: _Captured, kwargs: dict[str, Any]) -> None:
        for name, static in cap.inputs.items():
            given = kwargs.get(name)
            if given is None and name == "position_ids":
                given = self._positions(kwargs["input_ids"])
            with writing(static):
                static.copy_(given)

    # -- helpers -------------------------------------------------------------------------
    def _key(self, kwargs: dict[str, Any]) -> tuple:
        """What a capture depends on: the inputs' shapes and the other arguments."""
        shapes = tuple((name, tuple(kwargs[name].shape)) for name in _STATIC_INPUTS
                       if isinstance(kwargs.get(name), torch.Tensor))
        other = tuple(sorted((k, v) for k, v in kwargs.items()
                             if k not in _STATIC_INPUTS and k not in _CACHE_KWARGS
                             and k != "attention_mask" and not isinstance(v, torch.Tensor)))
        return shapes, other

    def _positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Positions of the step's tokens when the caller gave none (as the model infers
        them: the tokens seen so far)."""
        return torch.full_like(ids, self.cache.get_seq_length())


@contextmanager
def graphed_forward(model: torch.nn.Module, cache: GraphedCache, *,
                    compile_layers: bool = False) -> Iterator[DecodeGraph]:
    """Make ``model.forward`` serve ``cache``'s decode steps through a
    :class:`DecodeGraph` until the block ends (``compile_layers``: its fixed-shape steps
    run the decoder layers compiled, :class:`CompiledLayers`). Several caches may be open
    on one model and close in any order: each graph hands other calls to the forward it
    wraps."""
    compiled = CompiledLayers(model) if compile_layers else None
    graph = DecodeGraph(cache, model.forward, model.__dict__.get("forward"), compiled)
    model.forward = graph
    try:
        yield graph
    finally:
        _unlink(model, graph)
        graph.forget()


def _unlink(model: torch.nn.Module, graph: DecodeGraph) -> None:
    """Take ``graph`` out of ``model``'s chain of forwards."""
    node = model.__dict__.get("forward")
    if node is graph:
        if graph.previous is None:
            del model.forward  # the class's forward again
        else:
            model.forward = graph.previous
        return
    while isinstance(node, DecodeGraph):
        if node.forward is graph:
            node.forward, node.previous = graph.forward, graph.previous
            return
        node = node.forward


def _with_logits(output: Any, logits: torch.Tensor) -> Any:
    """A shallow copy of a model output with ``logits`` replaced."""
    fields = dict(output.items())
    fields["logits"] = logits
    return type(output)(**fields)
