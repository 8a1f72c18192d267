"""An append to one layer worked out before anything changes: :class:`StagedAppend`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StagedAppend"]


@dataclass(frozen=True, slots=True)
class StagedAppend:
    """A layer's steady zone after an append (:meth:`LayerState.stage
    <vecstore.engine.layer_state.LayerState.stage>`), and how many of its tail's first
    tokens the append indexes.

    Attributes
    ----------
    sink_keys, sink_values : torch.Tensor
        ``[Hkv, S, D]`` sinks after the append.
    pending_keys, pending_values : torch.Tensor
        ``[Hkv, T, D]`` the tail after the append, its first ``ready`` tokens still in it.
    ready : int
        Tail tokens to index now (0: none).
    start : int
        Position of the first of them.
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    pending_keys: torch.Tensor
    pending_values: torch.Tensor
    ready: int
    start: int

    def ready_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[Hkv, ready, D]`` keys and values to index (views of the tail)."""
        return self.pending_keys[:, :self.ready], self.pending_values[:, :self.ready]
