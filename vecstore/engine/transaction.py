"""What one store transaction changed in memory, so it can be committed or undone."""

from __future__ import annotations

from vecstore.engine.layer_indexes import LayerIndexes
from vecstore.engine.layer_mark import LayerMark
from vecstore.engine.layer_state import LayerState
from vecstore.engine.sequence import Sequence
from vecstore.storage.records import Changes, LayerWrite, NewSequenceSpec, SequenceEvent

__all__ = ["Transaction"]


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
            self.marks[key] = seq.layers[layer].mark()

    def created(self, seq: Sequence) -> None:
        self.events.append(("create", seq))

    def dropped(self, seq: Sequence) -> None:
        self.events.append(("drop", seq))

    def changes(self, indexes: LayerIndexes) -> Changes:
        """The transaction's changes as records for storage to commit: sequences created
        and dropped (in order), and each touched layer of a live sequence."""
        out = Changes()
        for kind, seq in self.events:
            spec = None
            if kind == "create":
                spec = NewSequenceSpec(seq.num_kv_heads, seq.head_dim, seq.dtype, seq.device,
                                       seq.fingerprint,
                                       tuple(indexes.kind(i) for i in range(seq.num_layers)))
            out.events.append(SequenceEvent(kind, seq.name, spec))
            if not seq.is_dropped:
                out.num_tokens[seq.name] = seq.num_tokens
        for (seq, layer), mark in self.marks.items():
            if seq.is_dropped:
                continue
            state = seq.layers[layer]
            out.layers.append(LayerWrite(
                seq.name, layer, indexes.kind(layer), state.num_tokens, state.num_indexed,
                state.sink_keys, state.sink_values, state.pending_keys, state.pending_values,
                state.segments, mark.num_segments, mark.num_sink, mark.num_pending))
            out.num_tokens[seq.name] = seq.num_tokens
        return out

    def rollback(self, seqs: dict[str, Sequence]) -> list[LayerState]:
        """Undo every change, restoring ``seqs`` (the store's name -> sequence map); returns
        the layers restored."""
        restored = []
        for (seq, layer), mark in self.marks.items():
            state = seq.layers[layer]
            state.restore(mark)
            restored.append(state)
        for kind, seq in reversed(self.events):
            if kind == "create":
                seqs.pop(seq.name, None)
                seq.is_dropped = True
            else:
                seqs[seq.name] = seq
                seq.is_dropped = False
        self.marks.clear()
        self.events.clear()
        return restored
