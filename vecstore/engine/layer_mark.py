"""A layer as a transaction first saw it, so the transaction can be undone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayerMark"]


@dataclass(frozen=True, slots=True)
class LayerMark:
    """A layer as it was when a transaction first touched it
    (:meth:`vecstore.engine.layer_state.LayerState.mark`).

    Tensors are never modified in place (appends build new ones), so keeping
    references is enough to restore them.
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    pending_keys: torch.Tensor
    pending_values: torch.Tensor
    num_segments: int

    @property
    def num_sink(self) -> int:
        return self.sink_keys.shape[1]

    @property
    def num_pending(self) -> int:
        return self.pending_keys.shape[1]
