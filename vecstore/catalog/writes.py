"""The writes of one catalog commit: new sequences with their layers, and per-layer
changes (segments, files, clusters, steady chunks, token counts), batched by row kind."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, insert, update
from sqlalchemy.orm import Session

from vecstore.catalog.records import ChunkRecord, LayerChange, NewSegment, NewSequence
from vecstore.catalog.schema import (
    ClusterRow,
    FileRow,
    LayerRow,
    SegmentRow,
    SequenceRow,
    SteadyChunkRow,
    sequence_checksum,
)

__all__ = ["insert_sequence", "apply_changes"]


def insert_sequence(s: Session, new: NewSequence, now: datetime,
                    layer_ids: dict[tuple[str, int], int]) -> int:
    """Add a sequence's row and its layers' rows; returns its id."""
    row = SequenceRow(name=new.name, directory=new.directory,
                      num_layers=len(new.index_kinds), num_kv_heads=new.num_kv_heads,
                      head_dim=new.head_dim, dtype=new.dtype, device=new.device,
                      fingerprint=new.fingerprint, num_tokens=0, created_at=now,
                      updated_at=now)
    row.checksum = sequence_checksum(row)
    s.add(row)
    s.flush()
    layers = [LayerRow(sequence_id=row.id, layer=i, num_tokens=0, index_kind=kind)
              for i, kind in enumerate(new.index_kinds)]
    s.add_all(layers)
    s.flush()
    for lr in layers:
        layer_ids[(new.name, lr.layer)] = lr.id
    return row.id

def apply_changes(s: Session, changes: list[LayerChange], seq_ids: dict[str, int],
                  layer_ids: dict[tuple[str, int], int], now: datetime) -> None:
    """Record every layer change of a commit."""
    # batched: one statement per kind of row, whatever the number of layers
    chunks: list[dict[str, object]] = []
    tails: list[int] = []
    counts: list[dict[str, int | str]] = []
    for change in changes:
        layer_id = layer_ids[(change.sequence, change.layer)]
        for seg in change.segments:
            _insert_segment(s, seg, seq_ids[change.sequence], layer_id, now)
        if change.replace_tail:
            tails.append(layer_id)
        chunks += [_chunk_row(layer_id, c) for c in (change.sink, change.tail)
                   if c is not None]
        row: dict[str, int | str] = {"id": layer_id, "num_tokens": change.num_tokens}
        if change.segments:
            row["index_kind"] = change.segments[0].index_kind
        counts.append(row)
    if tails:
        s.execute(delete(SteadyChunkRow).where(SteadyChunkRow.layer_id.in_(tails),
                                               SteadyChunkRow.zone == "tail"))
    if chunks:
        s.execute(insert(SteadyChunkRow), chunks)
    for keys in {tuple(r) for r in counts}:
        s.execute(update(LayerRow), [r for r in counts if tuple(r) == keys])


def _insert_segment(s: Session, seg: NewSegment, seq_id: int, layer_id: int,
                    now: datetime) -> None:
    f = FileRow(sequence_id=seq_id, path=seg.file.path, size=seg.file.size,
                checksum=seg.file.checksum, created_at=now)
    s.add(f)
    s.flush()
    row = SegmentRow(layer_id=layer_id, file_id=f.id, start=seg.start, end=seg.end,
                     num_units=seg.num_units, index_kind=seg.index_kind, **seg.params)
    s.add(row)
    s.flush()
    if seg.clusters is not None:
        s.execute(insert(ClusterRow), [
            {"segment_id": row.id, "head": h, "unit": u, "row_start": offs[u],
             "size": offs[u + 1] - offs[u]}
            for h, offs in enumerate(seg.clusters) for u in range(len(offs) - 1)])


def _chunk_row(layer_id: int, c: ChunkRecord) -> dict[str, object]:
    return {"layer_id": layer_id, "zone": c.zone, "first_token": c.first_token,
            "num_tokens": c.num_tokens, "keys": c.keys, "values": c.values,
            "checksum": c.checksum}
