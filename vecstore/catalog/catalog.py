"""The catalog: opening, schema versions, snapshots and one-transaction commits."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from vecstore.catalog.connections import make_engine, sql_errors
from vecstore.catalog.records import (
    ChunkRecord,
    Commit,
    FileRecord,
    LayerRecord,
    SegmentRecord,
    SequenceRecord,
)
from vecstore.catalog.schema import (
    FORMAT,
    SCHEMA_VERSION,
    Base,
    FileRow,
    LayerRow,
    SegmentRow,
    SequenceRow,
    SteadyChunkRow,
    StoreRow,
    sequence_checksum,
    text_checksum,
)
from vecstore.catalog.writes import apply_changes, insert_sequence
from vecstore.errors import CatalogError, CorruptionError, SchemaVersionError
from vecstore.version import __version__

__all__ = ["Catalog"]


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Catalog:
    """The SQLite catalog of one store.

    Every read runs in one snapshot transaction and every write in one explicit
    transaction, so a reader never sees part of a commit. Open with :meth:`open`;
    create a new file with :meth:`initialize`.

    Examples
    --------
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "catalog.sqlite"
    >>> Catalog.initialize(path, {"index": {"kind": "wave"}})
    >>> cat = Catalog.open(path, read_only=True)
    >>> cat.config, cat.load()
    ({'index': {'kind': 'wave'}}, [])
    >>> cat.close()
    """

    def __init__(self, path: Path, *, read_only: bool, immutable: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self._engine = make_engine(path, read_only=read_only, immutable=immutable)
        self._lock = threading.Lock()
        self._layer_ids: dict[tuple[str, int], int] = {}
        self._seq_ids: dict[str, int] = {}
        self.config: dict[str, Any] = {}

    # -- lifecycle -----------------------------------------------------------------------
    @staticmethod
    def initialize(path: Path, config: dict[str, Any]) -> None:
        """Write a new, empty catalog at ``path`` (which must not exist yet)."""

        engine = make_engine(path, read_only=False)
        try:
            with sql_errors(path):
                Base.metadata.create_all(engine)
                text_config = json.dumps(config, sort_keys=True)
                with Session(engine) as s, s.begin():
                    s.add(StoreRow(id=1, format=FORMAT, schema_version=SCHEMA_VERSION,
                                   created_by=f"vecstore {__version__}", created_at=_now(),
                                   config_json=text_config,
                                   config_checksum=text_checksum(text_config)))
                    s.execute(text(f"PRAGMA user_version = {SCHEMA_VERSION}"))
        finally:
            engine.dispose()

    @classmethod
    def open(cls, path: Path, *, read_only: bool, immutable: bool = False) -> Catalog:
        """Open an existing catalog, checking that it is a vecstore catalog of this
        schema version. ``immutable`` (read-only) reads the main file alone and creates
        no ``-wal``/``-shm`` file: for read-only media, and for checks while no writer runs.

        Raises
        ------
        CorruptionError
            The file is not an SQLite database or is damaged.
        SchemaVersionError
            It was written by an incompatible vecstore.
        CatalogError
            It is an SQLite file but not a vecstore catalog.
        """
        if path.stat().st_size == 0:
            raise CatalogError(f"{path} is an empty file, not a vecstore catalog")
        cat = cls(path, read_only=read_only, immutable=immutable)
        try:
            with sql_errors(path), cat._engine.connect() as conn:
                version = conn.exec_driver_sql("PRAGMA user_version").scalar()
                tables = set(conn.exec_driver_sql(
                    "SELECT name FROM sqlite_master WHERE type = 'table'").scalars())
                if "store" not in tables:
                    raise CatalogError(f"{path} is an SQLite file but not a vecstore catalog "
                                       "(it has no 'store' table)")
                row = conn.execute(select(StoreRow.format, StoreRow.schema_version,
                                          StoreRow.config_json, StoreRow.config_checksum)
                                   ).first()
            if row is None or row.format != FORMAT:
                raise CatalogError(f"{path} is not a vecstore catalog (store.format is "
                                   f"{None if row is None else row.format!r})")
            if version != SCHEMA_VERSION or row.schema_version != SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"catalog {path} has schema version {row.schema_version} "
                    f"(user_version {version}); this vecstore reads version {SCHEMA_VERSION}: "
                    "open it with the vecstore release that wrote it")
            if text_checksum(row.config_json) != row.config_checksum:
                raise CorruptionError(f"catalog {path} is corrupt: the stored config fails "
                                      "its checksum")
            cat.config = json.loads(row.config_json)
        except BaseException:
            cat.close()
            raise
        return cat

    def close(self) -> None:
        """Close the connection; safe to call twice."""
        self._engine.dispose()

    # -- reads ---------------------------------------------------------------------------
    def load(self) -> list[SequenceRecord]:
        """Every sequence with its layers, segments and steady chunks, from one snapshot."""
        with self._lock, sql_errors(self.path), Session(self._engine) as s, s.begin():
            seqs = s.scalars(select(SequenceRow).order_by(SequenceRow.id)).all()
            layers = s.execute(select(LayerRow).order_by(LayerRow.sequence_id,
                                                         LayerRow.layer)).scalars().all()
            segs = s.execute(
                select(SegmentRow.layer_id, SegmentRow.start, SegmentRow.end,
                       SegmentRow.num_units, SegmentRow.index_kind, FileRow.path,
                       FileRow.size, FileRow.checksum)
                .join(FileRow, SegmentRow.file_id == FileRow.id)
                .order_by(SegmentRow.layer_id, SegmentRow.start)).all()
            chunks = s.execute(
                select(SteadyChunkRow.layer_id, SteadyChunkRow.zone,
                       SteadyChunkRow.first_token, SteadyChunkRow.num_tokens,
                       SteadyChunkRow.keys, SteadyChunkRow.values, SteadyChunkRow.checksum)
                .order_by(SteadyChunkRow.layer_id, SteadyChunkRow.zone,
                          SteadyChunkRow.first_token)).all()
            seg_by_layer: dict[int, list[SegmentRecord]] = defaultdict(list)
            for r in segs:
                seg_by_layer[r.layer_id].append(SegmentRecord(
                    r.start, r.end, r.num_units, r.index_kind,
                    FileRecord(r.path, r.size, r.checksum)))
            chunk_by_layer: dict[int, list[ChunkRecord]] = defaultdict(list)
            for c in chunks:
                chunk_by_layer[c.layer_id].append(ChunkRecord(
                    c.zone, c.first_token, c.num_tokens, c.keys, c.values, c.checksum))
            layers_by_seq: dict[int, list[LayerRecord]] = defaultdict(list)
            names = {q.id: q.name for q in seqs}
            layer_ids: dict[tuple[str, int], int] = {}
            for lr in layers:
                layers_by_seq[lr.sequence_id].append(LayerRecord(
                    lr.layer, lr.num_tokens, lr.index_kind,
                    tuple(seg_by_layer[lr.id]), tuple(chunk_by_layer[lr.id])))
                layer_ids[(names[lr.sequence_id], lr.layer)] = lr.id
            self._seq_ids, self._layer_ids = {q.name: q.id for q in seqs}, layer_ids
            for q in seqs:
                if sequence_checksum(q) != q.checksum:
                    raise CorruptionError(f"catalog {self.path} is corrupt: the row of "
                                          f"sequence {q.id} ({q.name!r}) fails its checksum")
            return [SequenceRecord(
                q.id, q.name, q.directory, q.num_layers, q.num_kv_heads, q.head_dim, q.dtype,
                q.device, q.fingerprint, q.num_tokens, q.created_at, q.updated_at,
                tuple(layers_by_seq[q.id])) for q in seqs]

    def sequence_exists(self, seq_id: int) -> bool:
        """Whether sequence ``seq_id`` is still committed (a writer may have dropped it)."""
        with self._lock, sql_errors(self.path), Session(self._engine) as s, s.begin():
            return s.get(SequenceRow, seq_id) is not None

    def last_commit(self) -> datetime:
        """When the newest commit this catalog holds wrote a sequence or a file (the
        store's creation if none did); drops leave no time."""
        with self._lock, sql_errors(self.path), Session(self._engine) as s, s.begin():
            times = [s.scalar(select(func.max(SequenceRow.updated_at))),
                     s.scalar(select(func.max(FileRow.created_at))),
                     s.scalar(select(StoreRow.created_at))]
        return max(t for t in times if t is not None)

    def file_paths(self) -> set[str]:
        """The data files the latest commit names (a new snapshot)."""
        with self._lock, sql_errors(self.path), Session(self._engine) as s, s.begin():
            return set(s.scalars(select(FileRow.path)))

    def session(self) -> Session:
        """A session on the catalog for read-only inspection (``verify``, ``info``);
        use it as ``with catalog.session() as s, s.begin():``."""
        return Session(self._engine, expire_on_commit=False)

    # -- writes --------------------------------------------------------------------------
    def commit(self, plan: Commit) -> list[str]:
        """Apply ``plan`` in one transaction; returns the data directories of the dropped
        sequences (for the caller to delete after the commit)."""
        now = _now()
        seq_ids, layer_ids = dict(self._seq_ids), dict(self._layer_ids)
        with self._lock, sql_errors(self.path), Session(self._engine) as s, s.begin():
            gone = []
            for name in plan.dropped:
                row = s.scalars(select(SequenceRow).where(SequenceRow.name == name)).one()
                gone.append(row.directory)
                s.delete(row)
                seq_ids.pop(name, None)
                for key in [k for k in layer_ids if k[0] == name]:
                    del layer_ids[key]
            s.flush()
            for new in plan.created:
                seq_ids[new.name] = insert_sequence(s, new, now, layer_ids)
            apply_changes(s, plan.layers, seq_ids, layer_ids, now)
            for name, count in plan.sequence_tokens.items():
                s.execute(update(SequenceRow).where(SequenceRow.name == name)
                          .values(num_tokens=count, updated_at=now))
        self._seq_ids, self._layer_ids = seq_ids, layer_ids
        return gone

    def checkpoint(self) -> None:
        """Fold the WAL into the main file and truncate it."""
        with self._lock, sql_errors(self.path), self._engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
