"""A model's decoder layers compiled around their attention, for fixed-shape decode steps.

A captured decode step launches, beside its attention kernels, the model's own small
operations: per layer two RMSNorms of some eight kernels each, two residual adds, the
MLP's activation and product, a few microseconds each even replayed in a CUDA graph (a
Llama-3-8B layer: ~30 such kernels, ~70 us of a step). :class:`CompiledLayers` fuses them
with ``torch.compile`` (Inductor) and leaves each layer's attention module as it is: its
projections, RoPE, cache update and attention function run uncompiled, one graph break a
layer, the split serving engines make too (vLLM compiles its models piecewise, cut at
attention). The attention stays the store's (or the baseline's) own device step.

Compiled forwards are swapped in only while :meth:`CompiledLayers.active` lasts: the
fixed-shape steps, whose shapes repeat. Prefill and ordinary steps run the model as it is
(every new shape would compile again). Each layer shares one compiled graph per shape
(the layers' parameters are the graph's inputs); the first step of a shape compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from integrations.hf.capabilities import attention_modules
from vecstore.errors import IncompatibleError

__all__ = ["CompiledLayers", "decoder_layers"]


def decoder_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """Each decoder layer of ``model`` with its attention module, in layer order.

    Raises
    ------
    IncompatibleError
        If an attention module is not the direct child of a layer.
    """
    parents = {id(child): module for module in model.modules() for child in module.children()}
    pairs = []
    for attn in attention_modules(model):
        layer = parents.get(id(attn))
        if layer is None or layer is model:
            raise IncompatibleError(f"compile_layers: the attention module {type(attn).__name__}"
                                    " is not held by a decoder layer")
        pairs.append((layer, attn))
    return pairs


class CompiledLayers:
    """``model``'s decoder layers, each compiled with its attention module left out.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers decoder model (its attention modules found as
        :func:`~integrations.hf.capabilities.attention_modules` finds them).

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    ...     num_key_value_heads=1)).eval()
    >>> compiled = CompiledLayers(model)
    >>> with compiled.active():
    ...     "forward" in vars(model.model.layers[0])
    True
    >>> "forward" in vars(model.model.layers[0])
    False
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._pairs = decoder_layers(model)
        # made once: the compiled code is guarded on the attention forward it calls, so a new
        # wrapper at each activation would compile the layers again
        self._forwards = [(torch.compile(layer.forward, dynamic=False),
                           torch.compiler.disable(attn.forward))
                          for layer, attn in self._pairs]

    @contextmanager
    def active(self) -> Iterator[None]:
        """The compiled layers stand in for the layers' forwards until the block ends."""
        saved = [(_own(layer), _own(attn)) for layer, attn in self._pairs]
        try:
            for (layer, attn), (compiled, eager) in zip(self._pairs, self._forwards,
                                                        strict=True):
                layer.forward, attn.forward = compiled, eager
            yield
        finally:
            for (layer, attn), (layer_fwd, attn_fwd) in zip(self._pairs, saved, strict=True):
                _restore(layer, layer_fwd)
                _restore(attn, attn_fwd)


def _own(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The forward ``module`` holds itself (``None``: its class's)."""
    return module.__dict__.get("forward")


def _restore(module: torch.nn.Module, forward: Callable[..., Any] | None) -> None:
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward
