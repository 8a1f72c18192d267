"""What one store transaction changed in memory, so it can be committed or undone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vecstore.layer import LayerState

if TYPE_CHECKING:
    from vecstore.sequence import Sequence

__all__ = ["LayerMark", "Transaction"]


@dataclass(frozen=True, slots=True)
class LayerMark:
    """A layer as it was when the transaction first touched it.

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

    @staticmethod
    def of(state: LayerState) -> LayerMark:
        return LayerMark(state.sink_keys, state.sink_values, state.pending_keys,
                         state.pending_values, len(state.segments))

    def restore(self, state: LayerState) -> None:
        """Put ``state`` back as it was (and invalidate its cached view)."""
        state.sink_keys, state.sink_values = self.sink_keys, self.sink_values
        state.pending_keys, state.pending_values = self.pending_keys, self.pending_values
        state.segments = state.segments[:self.num_segments]
        state.add_segments([])  # bumps the version and drops the cached view


class Transaction:
    """The changes made since the transaction began: layers touched (with their
    marks), and sequences created and dropped, in order."""

    def __init__(self) -> None:
        self.marks: dict[tuple[Sequence, int], LayerMark] = {}
        self.events: list[tuple[str, Sequence]] = []

    def touch(self, seq: Sequence, layer: int) -> None:
        """Record ``layer`` of ``seq`` before its first change in this transaction."""
        key = (seq, layer)
        if key not in self.marks:
            self.marks[key] = LayerMark.of(seq.layers[layer])

    def created(self, seq: Sequence) -> None:
        self.events.append(("create", seq))

    def dropped(self, seq: Sequence) -> None:
        self.events.append(("drop", seq))

    def rollback(self, seqs: dict[str, Sequence]) -> None:
        """Undo every change, restoring ``seqs`` (the store's name -> sequence map)."""
        for (seq, layer), mark in self.marks.items():
            mark.restore(seq.layers[layer])
        for kind, seq in reversed(self.events):
            if kind == "create":
                seqs.pop(seq.name, None)
                seq.is_dropped = True
            else:
                seqs[seq.name] = seq
                seq.is_dropped = False
        self.marks.clear()
        self.events.clear()
