"""What storage takes from the engine and returns to it: plain records of tensors,
never the engine's objects."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vecstore.index.base import Segment

__all__ = ["Changes", "LayerWrite", "LoadedLayer", "NewSequenceSpec", "SequenceEvent"]


@dataclass(frozen=True, slots=True)
class LoadedLayer:
    """Everything a layer holds: ``[Hkv, S, D]`` sinks and tail, and its segments."""

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    pending_keys: torch.Tensor
    pending_values: torch.Tensor
    segments: list[Segment]


@dataclass(frozen=True, slots=True)
class NewSequenceSpec:
    """A sequence created in a transaction: its shape, and each layer's index kind."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    fingerprint: str | None
    index_kinds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SequenceEvent:
    """A sequence created (``spec`` given) or dropped in a transaction, by name."""

    kind: str  # "create" or "drop"
    name: str
    spec: NewSequenceSpec | None = None


@dataclass(frozen=True, slots=True)
class LayerWrite:
    """A layer a transaction changed: its contents now, and how much of them it held when
    the transaction first touched it (``num_segments``, ``num_sink``, ``num_pending``)."""

    name: str
    layer: int
    index_kind: str
    num_tokens: int
    num_indexed: int
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    pending_keys: torch.Tensor
    pending_values: torch.Tensor
    segments: list[Segment]
    num_segments: int
    num_sink: int
    num_pending: int


@dataclass(slots=True)
class Changes:
    """One transaction's changes, in the order they happened, for
    :meth:`~vecstore.storage.persistence.Persistence.commit`."""

    events: list[SequenceEvent] = field(default_factory=list)
    layers: list[LayerWrite] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)  # of every live sequence named
