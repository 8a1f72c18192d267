"""The layer a :class:`~integrations.hf.cache.WaveCache` gives transformers for each
full-attention layer: it counts the positions seen and stages each step for the layer's
attention call; the context itself lives in the store."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers import CacheLayerMixin

__all__ = ["StepStager", "WaveCacheLayer"]


class StepStager(Protocol):
    """What a :class:`WaveCacheLayer` asks of its cache (a
    :class:`~integrations.hf.cache.WaveCache`)."""

    def stage(self, layer: int) -> None:
        """Mark ``layer``'s next attention call as the cache's."""


class WaveCacheLayer(CacheLayerMixin):
    """One full-attention layer of a :class:`WaveCache`: counts tokens seen and stages
    each step.

    ``keys`` and ``values`` stay empty: the context lives in the store.
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, owner: StepStager, layer: int, seen: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer = layer
        self.seen = seen

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty(B, H, 0, D)
        self.values = value_states.new_empty(B, H, 0, D)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the step for this layer's attention call; returns the step's own KV."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner.stage(self.layer)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        """Every position seen (padding included), as transformers' masks count them."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1
