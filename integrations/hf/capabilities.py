"""What a model must do for vecstore to serve its KV cache, checked before anything runs.

There is no list of architectures. A decoder works when

- it dispatches attention through transformers' ``AttentionInterface`` (the model class
  sets ``_supports_attention_backend``), so vecstore's attention function can be switched in;
- each decoder layer has one attention module with a ``layer_idx`` that calls
  ``cache.update`` with post-RoPE keys and values and then the attention function;
- every layer's attention is either full (``"full_attention"``: through the store) or a
  sliding window (``"sliding_attention"``, or Mistral/Phi-3's ``config.sliding_window``:
  kept exactly in a windowed cache of its own, :mod:`integrations.hf.window_cache`);
- the attention is a softmax of ``q·k``, soft-capped or not (Gemma 2's
  ``attn_logit_softcapping``: every zone of the store's tripartite attention caps its
  scores), with no learned sinks.

:func:`model_shape` checks all of it and raises :class:`~vecstore.errors.IncompatibleError`
naming what fails, when a ``WaveCache`` is created, never after a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from vecstore import Sequence
from vecstore.checks import check_softcap
from vecstore.errors import IncompatibleError, InvalidValueError

__all__ = ["ModelShape", "model_shape", "attention_modules", "layer_windows", "check_sequence",
           "TESTED_MODEL_TYPES"]

TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
"""Architectures run token for token against ``DynamicCache`` in vecstore's test suite;
others that pass :func:`model_shape`'s checks are expected to work too."""

_FULL, _SLIDING = "full_attention", "sliding_attention"


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
    windows : tuple[int | None, ...]
        Per decoder layer, the sliding window of a sliding-window layer, ``None`` for a
        full-attention layer (empty = every layer full).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_devices: tuple[torch.device, ...]
    windows: tuple[int | None, ...] = ()

    @property
    def store_layers(self) -> tuple[int, ...]:
        """The decoder layers whose KV goes through the store (the full-attention ones)."""
        if not self.windows:
            return tuple(range(self.num_layers))
        return tuple(i for i, w in enumerate(self.windows) if w is None)

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """The sliding-window layers (kept exactly, outside the store)."""
        return tuple(i for i, w in enumerate(self.windows) if w is not None)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention module of each decoder layer, in layer order.

    A module with an integer ``layer_idx`` counts unless one of its submodules has the
    same ``layer_idx`` (a decoder layer that holds its attention module, as in Gemma 3).
    """
    tagged = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    inner = [m for m in tagged
             if not any(c is not m and getattr(c, "layer_idx", None) == m.layer_idx
                        for c in m.modules())]
    return sorted(inner, key=lambda m: m.layer_idx)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer, its sliding window (``None`` = full attention), as transformers'
    own ``DynamicCache(config=...)`` decides it.

    Raises
    ------
    IncompatibleError
        For a layer type other than full or sliding-window attention.
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        if getattr(config, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = [_SLIDING if window is not None else _FULL] * n
    unknown = sorted({t for t in types if t not in (_FULL, _SLIDING)})
    if unknown:
        raise IncompatibleError(
            f"model: layer types {unknown} are not supported; vecstore serves full-attention "
            "layers through its store and keeps sliding-window layers exactly, nothing else")
    if _SLIDING in types and not (isinstance(window, int) and window > 0):
        raise IncompatibleError(f"model: sliding-window layers need config.sliding_window > 0, "
                                f"got {window!r}")
    return tuple(window if t == _SLIDING else None for t in types)


def model_shape(model: Any) -> ModelShape:
    """Check that vecstore can serve ``model``'s KV cache and return its attention shape.

    Raises
    ------
    InvalidValueError
        If ``model`` is not a transformers ``PreTrainedModel``.
    IncompatibleError
        Naming the capability the model lacks.

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> shape = model_shape(LlamaForCausalLM(cfg))
    >>> shape.num_kv_heads, shape.head_dim, shape.store_layers
    (2, 8, (0, 1))
    """
    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or config is None:
        raise InvalidValueError(f"model: expected a transformers PreTrainedModel, got "
                                f"{type(model).__name__}")
    name, kind = type(model).__name__, getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise IncompatibleError(f"model: {name} ({kind!r}) is an encoder-decoder; vecstore "
                                "serves decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise IncompatibleError(
            f"model: {name} ({kind!r}) does not dispatch its attention through transformers' "
            "AttentionInterface, so vecstore's attention cannot be switched in")
    windows = layer_windows(config)
    n = config.num_hidden_layers
    modules = attention_modules(model)
    if [m.layer_idx for m in modules] != list(range(n)):
        raise IncompatibleError(
            f"model: {name} ({kind!r}) has attention modules for layers "
            f"{[m.layer_idx for m in modules]}, expected one per decoder layer 0..{n - 1}")
    _check_plain_softmax(config, modules, name, kind)
    heads = config.num_attention_heads
    groups = getattr(modules[0], "num_key_value_groups", 1)  # no attribute: one KV head each
    kv_heads = heads // groups if isinstance(groups, int) and groups > 0 else heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    param = next(model.parameters())
    return ModelShape(num_layers=n, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      dtype=param.dtype, device=param.device,
                      layer_devices=tuple(_execution_device(m) for m in modules),
                      windows=windows)


def _check_plain_softmax(config: Any, modules: list[torch.nn.Module], name: str,
                         kind: object) -> None:
    try:  # a soft-cap is computed by every zone; a cap of 0 or inf is a broken config
        check_softcap(getattr(config, "attn_logit_softcapping", None),
                      "config.attn_logit_softcapping")
    except InvalidValueError as exc:
        raise IncompatibleError(f"model: {name} ({kind!r}): {exc}") from None
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in modules):
        raise IncompatibleError(f"model: {name} ({kind!r}) has learned attention sinks, "
                                "which the store's attention does not compute")
    if getattr(config, "kv_sharing_modes", None) is not None:
        raise IncompatibleError(f"model: {name} ({kind!r}) shares KV between layers, which "
                                "vecstore's per-layer store does not")


def check_sequence(seq: Sequence, shape: ModelShape, fingerprint: str) -> None:
    """Check that the stored ``seq`` was built by the model of ``shape`` and ``fingerprint``
    and can be continued by it.

    Raises
    ------
    IncompatibleError
        Naming the field that differs, or why the model cannot continue a stored sequence.
    """
    if shape.windowed_layers:
        raise IncompatibleError(
            f"sequence {seq.name!r}: the model's sliding-window layers "
            f"{list(shape.windowed_layers)} keep their KV in memory, not in the store, so a "
            "stored sequence cannot be continued with this model; prefill it again")
    for what, stored, model in (("num_layers", seq.num_layers, shape.num_layers),
                                ("num_kv_heads", seq.num_kv_heads, shape.num_kv_heads),
                                ("head_dim", seq.head_dim, shape.head_dim),
                                ("dtype", seq.dtype, shape.dtype)):
        if stored != model:
            raise IncompatibleError(f"sequence {seq.name!r}: {what} is {stored} in the store "
                                    f"but {model} in the model")
    if seq.fingerprint != fingerprint:
        raise IncompatibleError(f"sequence {seq.name!r} was built for model "
                                f"{seq.fingerprint!r}, not for this one ({fingerprint!r})")
    counts = {seq.tokens(layer) for layer in range(seq.num_layers)}
    if len(counts) != 1:
        raise IncompatibleError(f"sequence {seq.name!r} is incomplete: its layers hold "
                                f"{sorted(counts)} tokens")


def _execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: its weights' device, or accelerate's execution device
    when the weights are offloaded (kept on ``meta`` until the forward pass)."""
    device = next(module.parameters()).device
    hook = getattr(module, "_hf_hook", None)
    if device.type == "meta" and getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    return device
