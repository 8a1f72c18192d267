"""Registering vecstore with transformers, and attaching it to a model, reversibly.

:func:`install` is the only place that touches transformers' global state. Inside it,

- the attention function and the mask function are registered under one name,
  ``"vecstore"``, with ``AttentionInterface`` and ``AttentionMaskInterface``;
- given a model, the model's attention implementation is switched to ``"vecstore"`` and
  a :class:`ModelBinding` is attached to its attention modules, through which a
  :class:`~integrations.hf.cache.WaveCache` hands each layer's step to the attention
  function.

Everything is undone on exit. Installs nest and may overlap in any order: the
registration and each model's binding count their users, and the last one out restores
what was there before. While installed, a forward pass that does not use a ``WaveCache``
runs transformers' ``sdpa`` attention unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from integrations.hf.attention_fn import BINDING_ATTR, vecstore_attention, vecstore_mask
from integrations.hf.capabilities import ModelShape, attention_modules, model_shape
from vecstore.errors import IncompatibleError

__all__ = ["ATTENTION_NAME", "AttendingCache", "ModelBinding", "ModelShape", "install",
           "model_shape", "model_fingerprint"]

ATTENTION_NAME = "vecstore"
"""The name the attention and mask functions are registered under."""

_MISSING = object()


class _Registration:
    """The attention callable registered under :data:`ATTENTION_NAME`; counts installs.

    It lives in transformers' own registry, so the count needs no global of ours.
    """

    def __init__(self, previous_attention: Any, previous_mask: Any) -> None:
        self.previous_attention = previous_attention
        self.previous_mask = previous_mask
        self.users = 0

    # opaque to torch.compile: decoder layers compile around the store's attention
    # (integrations.hf.layer_compile)
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return vecstore_attention(*args, **kwargs)


def _register() -> _Registration:
    attn_map: dict[str, Any] = AttentionInterface._global_mapping
    current = attn_map.get(ATTENTION_NAME, _MISSING)
    if isinstance(current, _Registration):
        current.users += 1
        return current
    mask_map: dict[str, Any] = AttentionMaskInterface._global_mapping
    reg = _Registration(current, mask_map.get(ATTENTION_NAME, _MISSING))
    reg.users = 1
    AttentionInterface.register(ATTENTION_NAME, reg)
    AttentionMaskInterface.register(ATTENTION_NAME, vecstore_mask)
    return reg


def _unregister(reg: _Registration) -> None:
    reg.users -= 1
    if reg.users > 0:
        return
    for mapping, previous in ((AttentionInterface._global_mapping, reg.previous_attention),
                              (AttentionMaskInterface._global_mapping, reg.previous_mask)):
        if previous is _MISSING:
            mapping.pop(ATTENTION_NAME, None)
        else:
            mapping[ATTENTION_NAME] = previous


class AttendingCache(Protocol):
    """What the attention function asks of the cache that staged a step (a
    :class:`~integrations.hf.cache.WaveCache`)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               valid: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        """Attention of one layer's step."""


class ModelBinding:
    """Per-model state shared by its attention modules while vecstore is installed.

    A :class:`~integrations.hf.cache.WaveCache` stages each layer's step here in
    ``cache.update``; the attention function of that layer takes it right after. A
    forward pass with any other cache stages nothing, and the attention function falls
    back to ``sdpa``.
    """

    def __init__(self, previous_implementation: str) -> None:
        self.previous_implementation = previous_implementation
        self.users = 0
        self._staged: tuple[AttendingCache, int] | None = None

    def stage(self, cache: AttendingCache, layer: int) -> None:
        """Mark ``layer``'s next attention call as belonging to ``cache``."""
        self._staged = (cache, layer)

    def take(self, layer: int) -> AttendingCache | None:
        """The cache that staged ``layer``'s current step, if any (clears the mark)."""
        staged, self._staged = self._staged, None
        if staged is None or staged[1] != layer:
            return None
        return staged[0]


@contextmanager
def _attach(model: PreTrainedModel) -> Iterator[ModelBinding]:
    binding = getattr(model, BINDING_ATTR, None)
    if binding is None:
        binding = ModelBinding(model.config._attn_implementation)
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:
            raise IncompatibleError(f"model: {type(model).__name__} cannot switch its attention "
                                    "implementation (it does not dispatch through "
                                    "transformers' AttentionInterface)")
        for module in [model, *attention_modules(model)]:
            setattr(module, BINDING_ATTR, binding)
    binding.users += 1
    try:
        yield binding
    finally:
        binding.users -= 1
        if binding.users == 0:
            for module in [model, *attention_modules(model)]:
                delattr(module, BINDING_ATTR)
            model.set_attn_implementation(binding.previous_implementation)


@contextmanager
def install(model: PreTrainedModel | None = None) -> Iterator[ModelBinding | None]:
    """Register vecstore's attention with transformers, optionally switching ``model`` to it.

    Parameters
    ----------
    model : PreTrainedModel, optional
        A model that passes :func:`~integrations.hf.capabilities.model_shape`'s checks;
        its attention implementation becomes ``"vecstore"`` until the last install of it
        exits.

    Yields
    ------
    ModelBinding | None
        The model's binding, or ``None`` without a model.

    Raises
    ------
    IncompatibleError
        If ``model`` lacks a capability vecstore needs (named in the message).

    Examples
    --------
    >>> from transformers import AttentionInterface
    >>> with install():
    ...     "vecstore" in AttentionInterface._global_mapping
    True
    >>> "vecstore" in AttentionInterface._global_mapping
    False
    """
    if model is not None:
        model_shape(model)
    reg = _register()
    try:
        if model is None:
            yield None
        else:
            with _attach(model) as binding:
                yield binding
    finally:
        _unregister(reg)


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short digest of what makes a model's KV cache meaningful to it.

    It covers the architecture (type, layers, heads, head dimension, hidden size, RoPE
    settings, vocabulary, sliding windows), the dtype, and the first layer's key
    projection weights (its first attention weights when it has no ``k_proj``), so a
    store built by another checkpoint of the same architecture is told apart.

    Returns
    -------
    str
        ``"<model_type>-<16 hex digits>"``.
    """
    shape = model_shape(model)
    config = model.config
    fields: dict[str, Any] = {
        "model_type": config.model_type, "num_layers": shape.num_layers,
        "num_q_heads": shape.num_q_heads, "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size, "dtype": str(shape.dtype),
        "rope": getattr(config, "rope_parameters", None),
    }
    if shape.windowed_layers:
        fields["windows"] = shape.windows
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    first = attention_modules(model)[0]
    k_proj = getattr(first, "k_proj", None)
    weight = k_proj.weight if k_proj is not None else next(first.parameters())
    if weight.device.type != "meta":
        digest.update(weight.detach().to("cpu", torch.float32).numpy().tobytes())
    return f"{config.model_type}-{digest.hexdigest()[:16]}"
