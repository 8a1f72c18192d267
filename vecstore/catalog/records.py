"""Plain records that cross the catalog boundary: what a snapshot holds and what a
commit writes. ORM objects never leave a catalog session."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

__all__ = [
    "FileRecord",
    "SegmentRecord",
    "ChunkRecord",
    "LayerRecord",
    "SequenceRecord",
    "NewSequence",
    "NewSegment",
    "LayerChange",
    "Commit",
]


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A data file: ``path`` relative to the store (POSIX form), ``size`` in bytes and
    ``checksum`` as ``"sha256:<hex>"``."""

    path: str
    size: int
    checksum: str


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    """A committed segment: tokens ``[start, end)`` in ``num_units`` units."""

    start: int
    end: int
    num_units: int
    index_kind: str
    file: FileRecord


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """A piece of a steady zone (``zone`` is ``sink`` or ``tail``) as raw bytes."""

    zone: str
    first_token: int
    num_tokens: int
    keys: bytes
    values: bytes
    checksum: str


@dataclass(frozen=True, slots=True)
class LayerRecord:
    """A committed layer: its segments in token order and its steady chunks."""

    layer: int
    num_tokens: int
    index_kind: str
    segments: tuple[SegmentRecord, ...]
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """A committed sequence and its layers."""

    id: int
    name: str
    directory: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    fingerprint: str | None
    num_tokens: int
    created_at: datetime
    updated_at: datetime
    layers: tuple[LayerRecord, ...]


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence to insert, with the index kind of each layer."""

    name: str
    directory: str
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    fingerprint: str | None
    index_kinds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NewSegment:
    """A segment whose file is already written; ``clusters`` holds, for clustered
    segments, each KV head's row offsets (``U + 1`` of them), else ``None``."""

    start: int
    end: int
    num_units: int
    index_kind: str
    params: dict[str, int | str]
    file: FileRecord
    clusters: list[list[int]] | None


@dataclass(slots=True)
class LayerChange:
    """What one commit changes in one layer."""

    sequence: str
    layer: int
    num_tokens: int
    segments: list[NewSegment] = field(default_factory=list)
    sink: ChunkRecord | None = None
    replace_tail: bool = False
    tail: ChunkRecord | None = None


@dataclass(slots=True)
class Commit:
    """One catalog transaction: drops first, then creations, then layer changes."""

    dropped: list[str] = field(default_factory=list)
    created: list[NewSequence] = field(default_factory=list)
    layers: list[LayerChange] = field(default_factory=list)
    sequence_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.dropped or self.created or self.layers)
