"""The catalog's tables: SQLAlchemy 2 typed ORM models.

One SQLite file (``<store>/catalog.sqlite``) describes a store: its settings, its
sequences and their layers, the segments each layer's index built, every cluster of a
clustered segment, the data files holding the rows, and each layer's steady zone.

=================  =============================================================
table              one row per
=================  =============================================================
``store``          store (exactly one): format, schema version, settings
``sequences``      sequence: name, shape, dtype, fingerprint, token count, times
``layers``         (sequence, layer): token count and the index kind it uses
``files``          immutable data file: path relative to the store, size, sha256
``segments``       indexed token range: ``[start, end)``, clustering parameters, file
``clusters``       cluster of a clustered segment: KV head, unit, rows
``steady_chunks``  piece of a steady zone (sinks or tail): raw bytes plus checksum
=================  =============================================================

Deleting a sequence cascades (``ON DELETE CASCADE``, foreign keys are on) to its
layers, files, segments, clusters and steady chunks.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

from sqlalchemy import ForeignKey, Index, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "SCHEMA_VERSION",
    "FORMAT",
    "Base",
    "StoreRow",
    "SequenceRow",
    "LayerRow",
    "FileRow",
    "SegmentRow",
    "ClusterRow",
    "SteadyChunkRow",
    "text_checksum",
    "sequence_checksum",
]

SCHEMA_VERSION = 1
"""Bumped whenever a table changes; also kept in ``PRAGMA user_version``."""

FORMAT = "vecstore"
"""Value of ``store.format``: tells a vecstore catalog from any other SQLite file."""


class Base(DeclarativeBase):
    """Declarative base of the catalog models."""


class StoreRow(Base):
    """The store itself (a single row, ``id = 1``)."""

    __tablename__ = "store"

    id: Mapped[int] = mapped_column(primary_key=True)
    format: Mapped[str] = mapped_column(String(32))
    schema_version: Mapped[int]
    created_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    config_json: Mapped[str]
    config_checksum: Mapped[str] = mapped_column(String(80))


class SequenceRow(Base):
    """A sequence; its data lives under ``data/<directory>/`` (a random hex name, so a
    user-chosen name never becomes a path). ``checksum`` covers the fields fixed at
    creation (:func:`sequence_checksum`), so a flipped name or fingerprint is caught."""

    __tablename__ = "sequences"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    directory: Mapped[str] = mapped_column(String(64), unique=True)
    num_layers: Mapped[int]
    num_kv_heads: Mapped[int]
    head_dim: Mapped[int]
    dtype: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(32))
    fingerprint: Mapped[str | None]
    num_tokens: Mapped[int]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    checksum: Mapped[str] = mapped_column(String(80))


class LayerRow(Base):
    """One layer of a sequence."""

    __tablename__ = "layers"
    __table_args__ = (UniqueConstraint("sequence_id", "layer"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    sequence_id: Mapped[int] = mapped_column(ForeignKey("sequences.id", ondelete="CASCADE"))
    layer: Mapped[int]
    num_tokens: Mapped[int]
    index_kind: Mapped[str] = mapped_column(String(32))


class FileRow(Base):
    """An immutable data file, written before the commit that names it."""

    __tablename__ = "files"

    id: Mapped[int] = mapped_column(primary_key=True)
    sequence_id: Mapped[int] = mapped_column(ForeignKey("sequences.id", ondelete="CASCADE"),
                                             index=True)
    path: Mapped[str] = mapped_column(String(256), unique=True)
    size: Mapped[int]
    checksum: Mapped[str] = mapped_column(String(80))
    created_at: Mapped[datetime]


class SegmentRow(Base):
    """An indexed token range ``[start, end)`` of one layer and how it was built."""

    __tablename__ = "segments"
    __table_args__ = (UniqueConstraint("layer_id", "start"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    layer_id: Mapped[int] = mapped_column(ForeignKey("layers.id", ondelete="CASCADE"))
    file_id: Mapped[int] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"),
                                         unique=True)
    start: Mapped[int]
    end: Mapped[int]
    num_units: Mapped[int]
    index_kind: Mapped[str] = mapped_column(String(32))
    tokens_per_cluster: Mapped[int]
    segment_tokens: Mapped[int]
    kmeans_iters: Mapped[int]
    clusterer: Mapped[str] = mapped_column(String(32))
    seed: Mapped[int]


class ClusterRow(Base):
    """One cluster of a clustered segment (``wave``).

    Its rows are ``keys``/``values[head, row_start : row_start + size]`` of the
    segment's file; its centroid and value sum are ``meta.centroids[head, unit]`` and
    ``meta.value_sums[head, unit]`` of the same file.
    """

    __tablename__ = "clusters"
    __table_args__ = {"sqlite_with_rowid": False}

    segment_id: Mapped[int] = mapped_column(ForeignKey("segments.id", ondelete="CASCADE"),
                                            primary_key=True)
    head: Mapped[int] = mapped_column(primary_key=True)
    unit: Mapped[int] = mapped_column(primary_key=True)
    row_start: Mapped[int]
    size: Mapped[int]


class SteadyChunkRow(Base):
    """Tokens ``[first_token, first_token + num_tokens)`` of a layer's steady zone.

    ``zone`` is ``sink`` or ``tail``. ``keys`` and ``values`` hold the ``[Hkv, n, D]``
    tensors' raw bytes; ``checksum`` is the sha256 of keys then values.
    """

    __tablename__ = "steady_chunks"
    __table_args__ = (Index("ix_steady_layer", "layer_id", "zone", "first_token"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    layer_id: Mapped[int] = mapped_column(ForeignKey("layers.id", ondelete="CASCADE"))
    zone: Mapped[str] = mapped_column(String(8))
    first_token: Mapped[int]
    num_tokens: Mapped[int]
    keys: Mapped[bytes] = mapped_column(LargeBinary)
    values: Mapped[bytes] = mapped_column(LargeBinary)
    checksum: Mapped[str] = mapped_column(String(80))


def text_checksum(text: str) -> str:
    """``"sha256:<hex>"`` of ``text`` (UTF-8)."""
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


def sequence_checksum(row: SequenceRow) -> str:
    """Checksum of a sequence row's fields fixed at creation."""
    return text_checksum(json.dumps([row.name, row.directory, row.num_layers, row.num_kv_heads,
                                     row.head_dim, row.dtype, row.device, row.fingerprint]))
