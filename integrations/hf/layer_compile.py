"""A model's decoder layers compiled around their attention, for fixed-shape decode steps.

A captured decode step launches, beside its attention kernels, the model's own small
operations: per layer two RMSNorms of some eight kernels each, RoPE's products, negation
and concatenations for the queries and the keys, two residual adds, the MLP's activation
and product; once a step the final norm and the rotary embedding's cosines and sines; a
microsecond or two each even replayed in a CUDA graph. :class:`CompiledLayers` fuses them
with ``torch.compile`` (Inductor): each decoder layer is compiled whole but for the cache's
``update`` and the attention function, which are opaque to the compiler
(``torch.compiler.disable``: :meth:`integrations.hf.cache.WaveCache.update` and the
attention function registered under ``"vecstore"``), two graph breaks a layer: the cut
serving engines make too (vLLM compiles its models piecewise, split at attention). The
attention stays the store's (or the baseline's) own device step.

Compiled forwards are swapped in only while :meth:`CompiledLayers.active` lasts: the
fixed-shape steps, whose shapes repeat. Prefill and ordinary steps run the model as it is
(every new shape would compile again). The code before a layer's cache update compiles
once per layer (each layer passes its own ``layer_idx``, a constant to the compiler; the
graphs are the same, and Inductor's cache serves all but the first), the rest once for all
layers; the first fixed-shape step of a batch size compiles them, and a new cache of the
same type reuses them. Dynamo's limit on compiled variants of one frame is raised while the
layers are active to cover ``_VARIANTS`` batch sizes or cache types per layer: past it, a
layer would run uncompiled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from integrations.hf.capabilities import attention_modules
from vecstore.errors import IncompatibleError

__all__ = ["CompiledLayers", "decoder_layers"]

_SHARED_FRAMES = 8  # dynamo's own default limit of compiled variants of one frame
_VARIANTS = 8  # batch sizes and cache types a process may compile each layer for


def decoder_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """Each decoder layer of ``model`` with its attention module, in layer order.

    Raises
    ------
    IncompatibleError
        If an attention module is not the direct child of a layer.
    """
    parents = _parents(model)
    pairs = []
    for attn in attention_modules(model):
        layer = parents.get(id(attn))
        if layer is None or layer is model:
            raise IncompatibleError(f"compile_layers: the attention module {type(attn).__name__}"
                                    " is not held by a decoder layer")
        pairs.append((layer, attn))
    return pairs


def _parents(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    return {id(child): module for module in model.modules() for child in module.children()}


def _around_layers(model: torch.nn.Module, first_layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules the decoder holds beside its layers and embeddings, which see no cache:
    its final norm and rotary embedding (none where the layers sit elsewhere)."""
    parents = _parents(model)
    stack = parents.get(id(first_layer))
    decoder = parents.get(id(stack)) if isinstance(stack, torch.nn.ModuleList) else None
    if decoder is None:
        return []
    return [child for child in decoder.children()
            if not isinstance(child, (torch.nn.ModuleList, torch.nn.Embedding))]


class CompiledLayers:
    """``model``'s decoder layers and the modules beside them (final norm, rotary
    embedding), compiled.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers decoder model (its layers found by their attention modules, as
        :func:`~integrations.hf.capabilities.attention_modules` finds them), run with a
        cache whose ``update`` and an attention function that are opaque to the compiler
        (a :class:`~integrations.hf.cache.WaveCache`; any other is compiled into the
        layers' graphs as transformers' own caches are).

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    ...     num_key_value_heads=1)).eval()
    >>> compiled = CompiledLayers(model)
    >>> with compiled.active():
    ...     "forward" in vars(model.model.layers[0]), "forward" in vars(model.model.norm)
    (True, True)
    >>> "forward" in vars(model.model.layers[0])
    False
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = [layer for layer, _ in decoder_layers(model)]
        around = _around_layers(model, layers[0]) if layers else []
        self._swaps = [(m, torch.compile(m.forward, dynamic=False)) for m in layers + around]
        # a frame per layer before its cache update for each batch size and cache type (a
        # FullCache beside the WaveCaches in a benchmark), and the frames shared by all
        self._limit = len(layers) * _VARIANTS + _SHARED_FRAMES

    @contextmanager
    def active(self) -> Iterator[None]:
        """The compiled forwards stand in for the modules' own until the block ends."""
        saved = [(module, module.__dict__.get("forward")) for module, _ in self._swaps]
        limit = max(self._limit, torch._dynamo.config.recompile_limit)
        try:
            for module, forward in self._swaps:
                module.forward = forward
            with torch._dynamo.config.patch(recompile_limit=limit):
                yield
        finally:
            for module, forward in saved:
                _restore(module, forward)


def _restore(module: torch.nn.Module, forward: Callable[..., Any] | None) -> None:
    """Give ``module`` back the forward it held itself (``None``: its class's)."""
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward
