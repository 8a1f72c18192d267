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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from integrations.hf.attention_fn import BINDING_ATTR, vecstore_attention, vecstore_mask
from vecstore.errors import IncompatibleError, InvalidValueError

if TYPE_CHECKING:
    from integrations.hf.cache import WaveCache

__all__ = ["ATTENTION_NAME", "SUPPORTED_MODEL_TYPES", "ModelBinding", "ModelShape", "install",
           "model_shape", "model_fingerprint"]

ATTENTION_NAME = "vecstore"
"""The name the attention and mask functions are registered under."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""Decoder-only, full-attention, RoPE, GQA architectures whose attention modules call
``cache.update`` and then the registered attention function."""

_MISSING = object()


class _Registration:
    """The attention callable registered under :data:`ATTENTION_NAME`; counts installs.

    It lives in transformers' own registry, so the count needs no global of ours.
    """

    def __init__(self, previous_attention: Any, previous_mask: Any) -> None:
        self.previous_attention = previous_attention
        self.previous_mask = previous_mask
        self.users = 0

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
        self._staged: tuple[WaveCache, int] | None = None

    def stage(self, cache: WaveCache, layer: int) -> None:
        """Mark ``layer``'s next attention call as belonging to ``cache``."""
        self._staged = (cache, layer)

    def take(self, layer: int) -> WaveCache | None:
        """The cache that staged ``layer``'s current step, if any (clears the mark)."""
        staged, self._staged = self._staged, None
        if staged is None or staged[1] != layer:
            return None
        return staged[0]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int)
            and hasattr(m, "num_key_value_groups")]


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
        for module in [model, *_attention_modules(model)]:
            setattr(module, BINDING_ATTR, binding)
    binding.users += 1
    try:
        yield binding
    finally:
        binding.users -= 1
        if binding.users == 0:
            for module in [model, *_attention_modules(model)]:
                delattr(module, BINDING_ATTR)
            model.set_attn_implementation(binding.previous_implementation)


@contextmanager
def install(model: PreTrainedModel | None = None) -> Iterator[ModelBinding | None]:
    """Register vecstore's attention with transformers, optionally switching ``model`` to it.

    Parameters
    ----------
    model : PreTrainedModel, optional
        A supported model (:data:`SUPPORTED_MODEL_TYPES`); its attention implementation
        becomes ``"vecstore"`` until the last install of it exits.

    Yields
    ------
    ModelBinding | None
        The model's binding, or ``None`` without a model.

    Raises
    ------
    IncompatibleError
        If ``model``'s architecture is not supported.

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


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The attention shape of a model, what a stored sequence must match.

    Attributes
    ----------
    num_layers, num_q_heads, num_kv_heads, head_dim : int
        Decoder layers, query heads, KV heads and head dimension.
    dtype : torch.dtype
        Parameter dtype (the KV dtype).
    device : torch.device
        Where the model's parameters live.
    layer_devices : tuple[torch.device, ...]
        The device each decoder layer's attention runs on (differs per layer for models
        dispatched over several GPUs, e.g. by accelerate's ``device_map="auto"``).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_devices: tuple[torch.device, ...]


def model_shape(model: Any) -> ModelShape:
    """Check that vecstore supports ``model`` and return its attention shape.

    Raises
    ------
    IncompatibleError
        Naming the architecture and what is supported.
    """
    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or config is None:
        raise InvalidValueError(f"model: expected a transformers PreTrainedModel, got "
                                f"{type(model).__name__}")
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise IncompatibleError(
            f"model: architecture {kind!r} is not supported by vecstore's transformers "
            f"integration; supported: {', '.join(SUPPORTED_MODEL_TYPES)} (decoder-only, "
            "full attention in every layer)")
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    mistral_window = kind == "mistral" and getattr(config, "sliding_window", None) is not None
    if types != {"full_attention"} or mistral_window:
        raise IncompatibleError(
            f"model: {kind} with sliding-window layers is not supported (vecstore attends to "
            "the whole context); use a config with sliding_window=None / full attention")
    modules = _attention_modules(model)
    if len(modules) != config.num_hidden_layers:
        raise IncompatibleError(f"model: found {len(modules)} attention modules for "
                                f"{config.num_hidden_layers} layers")
    param = next(model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(num_layers=config.num_hidden_layers,
                      num_q_heads=config.num_attention_heads,
                      num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                      dtype=param.dtype, device=param.device,
                      layer_devices=tuple(_execution_device(m) for m in sorted(
                          modules, key=lambda m: m.layer_idx)))


def _execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: its weights' device, or accelerate's execution device
    when the weights are offloaded (kept on ``meta`` until the forward pass)."""
    device = next(module.parameters()).device
    hook = getattr(module, "_hf_hook", None)
    if device.type == "meta" and getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    return device


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short digest of what makes a model's KV cache meaningful to it.

    It covers the architecture (type, layers, heads, head dimension, hidden size, RoPE
    settings, vocabulary), the dtype, and the first layer's key projection weights, so
    a store built by another checkpoint of the same architecture is told apart.

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
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    k_proj = getattr(_attention_modules(model)[0], "k_proj", None)
    if k_proj is not None:
        digest.update(k_proj.weight.detach().to("cpu", torch.float32).numpy().tobytes())
    return f"{config.model_type}-{digest.hexdigest()[:16]}"
