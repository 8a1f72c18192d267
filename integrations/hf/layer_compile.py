"""A model's decoder layers compiled around their attention, for fixed-shape decode steps.

A captured decode step launches, beside its attention kernels, the model's own small
operations: per layer two RMSNorms of some eight kernels each, two residual adds, the
MLP's activation and product; once a step the final norm and the rotary embedding's
cosines and sines; a microsecond or two each even replayed in a CUDA graph.
:class:`CompiledLayers` fuses them with ``torch.compile`` (Inductor) and leaves each
layer's attention module as it is: its projections, RoPE, cache update and attention
function run uncompiled, one graph break a layer, the split serving engines make too (vLLM
compiles its models piecewise, cut at attention). The attention stays the store's (or the
baseline's) own device step.

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
    """``model``'s decoder layers, each compiled with its attention module left out, and
    the modules beside them (final norm, rotary embedding) compiled.

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
    ...     "forward" in vars(model.model.layers[0]), "forward" in vars(model.model.norm)
    (True, True)
    >>> "forward" in vars(model.model.layers[0])
    False
    """

    def __init__(self, model: torch.nn.Module) -> None:
        pairs = decoder_layers(model)
        around = _around_layers(model, pairs[0][0]) if pairs else []
        # made once: the compiled code is guarded on the attention forward it calls, so a new
        # wrapper at each activation would compile the layers again
        self._swaps = [
            *((m, torch.compile(m.forward, dynamic=False))
              for m in [layer for layer, _ in pairs] + around),
            *((attn, torch.compiler.disable(attn.forward)) for _, attn in pairs)]

    @contextmanager
    def active(self) -> Iterator[None]:
        """The compiled forwards stand in for the modules' own until the block ends."""
        saved = [(module, module.__dict__.get("forward")) for module, _ in self._swaps]
        try:
            for module, forward in self._swaps:
                module.forward = forward
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
