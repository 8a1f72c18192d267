"""``info`` (what a store holds and what it costs on disk) and ``gc`` (unnamed files)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from vecstore.catalog.connections import sql_errors
from vecstore.catalog.schema import (
    ClusterRow,
    FileRow,
    LayerRow,
    SegmentRow,
    SequenceRow,
    SteadyChunkRow,
    StoreRow,
)
from vecstore.checks import SUPPORTED_DTYPES
from vecstore.storage.orphans import find_orphans
from vecstore.storage.persistence import Persistence

__all__ = ["SequenceInfo", "StoreInfo", "GcReport", "describe", "collect_garbage"]


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """One sequence as committed.

    ``raw_kv_bytes`` is what its keys and values take uncompressed (tokens x layers x
    2 x KV heads x head_dim x dtype size); ``data_bytes`` its segment files and
    ``steady_bytes`` its steady zones in the catalog.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    fingerprint: str | None
    num_tokens: int
    num_segments: int
    num_clusters: int
    data_bytes: int
    steady_bytes: int
    raw_kv_bytes: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """What :meth:`vecstore.Store.info` reports.

    ``disk_bytes`` counts every file of the store directory (catalog and WAL
    included); ``raw_kv_bytes`` sums the sequences' uncompressed KV.

    Examples
    --------
    >>> import tempfile
    >>> from vecstore import Store
    >>> with Store.open(tempfile.mkdtemp()) as store:
    ...     _ = store.create("doc", num_layers=2, num_kv_heads=1, head_dim=4,
    ...                      dtype="float16")
    ...     info = store.info()
    >>> [(q.name, q.num_layers, q.num_tokens) for q in info.sequences]
    [('doc', 2, 0)]
    """

    path: Path
    schema_version: int
    created_by: str
    created_at: datetime
    config: dict[str, Any]
    sequences: list[SequenceInfo]
    disk_bytes: int
    catalog_bytes: int
    raw_kv_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (paths and times as strings)."""
        d = asdict(self)
        d["path"] = str(self.path)
        for item in [d, *d["sequences"]]:
            for key in ("created_at", "updated_at"):
                if key in item:
                    item[key] = item[key].isoformat()
        return d

    def summary(self) -> str:
        """A human-readable table."""
        mib = 2.0 ** 20
        ratio = self.disk_bytes / self.raw_kv_bytes if self.raw_kv_bytes else 0.0
        lines = [f"store {self.path} (schema {self.schema_version}, {self.created_by})",
                 f"disk {self.disk_bytes / mib:.1f} MiB (catalog {self.catalog_bytes / mib:.1f}"
                 f" MiB); raw KV {self.raw_kv_bytes / mib:.1f} MiB; disk/raw {ratio:.3f}",
                 f"{'sequence':<24} {'layers':>6} {'kv x dim':>9} {'dtype':>8} {'tokens':>9} "
                 f"{'segments':>8} {'clusters':>9} {'MiB':>9}"]
        for q in self.sequences:
            lines.append(f"{q.name:<24} {q.num_layers:>6} {f'{q.num_kv_heads}x{q.head_dim}':>9} "
                         f"{q.dtype:>8} {q.num_tokens:>9} {q.num_segments:>8} "
                         f"{q.num_clusters:>9} {(q.data_bytes + q.steady_bytes) / mib:>9.1f}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class GcReport:
    """What :meth:`vecstore.Store.gc` removed (relative paths, bytes freed) and kept:
    files that may hold commits the catalog lost with its ``-wal`` file."""

    removed: list[str]
    bytes_freed: int
    kept: list[str] = field(default_factory=list)


def describe(p: Persistence) -> StoreInfo:
    """Aggregate the catalog (one snapshot) and the directory's disk use."""
    cat = p.catalog
    with sql_errors(cat.path), cat.session() as s, s.begin():
        store = s.execute(select(StoreRow)).scalars().one()
        by_layer = select(LayerRow.id, LayerRow.sequence_id).subquery()
        tokens = dict(s.execute(select(LayerRow.sequence_id, func.sum(LayerRow.num_tokens))
                                .group_by(LayerRow.sequence_id)).all())
        segments: dict[int, int] = dict(s.execute(
            select(by_layer.c.sequence_id, func.count(SegmentRow.id))
            .join(by_layer, SegmentRow.layer_id == by_layer.c.id)
            .group_by(by_layer.c.sequence_id)).all())
        clusters: dict[int, int] = dict(s.execute(
            select(by_layer.c.sequence_id, func.count())
            .select_from(ClusterRow).join(SegmentRow, ClusterRow.segment_id == SegmentRow.id)
            .join(by_layer, SegmentRow.layer_id == by_layer.c.id)
            .group_by(by_layer.c.sequence_id)).all())
        data = dict(s.execute(select(FileRow.sequence_id, func.sum(FileRow.size))
                              .group_by(FileRow.sequence_id)).all())
        steady = dict(s.execute(
            select(by_layer.c.sequence_id, func.sum(func.length(SteadyChunkRow.keys)
                                                    + func.length(SteadyChunkRow.values)))
            .join(by_layer, SteadyChunkRow.layer_id == by_layer.c.id)
            .group_by(by_layer.c.sequence_id)).all())
        infos = []
        for q in s.scalars(select(SequenceRow).order_by(SequenceRow.name)):
            item = SUPPORTED_DTYPES[q.dtype].itemsize if q.dtype in SUPPORTED_DTYPES else 0
            infos.append(SequenceInfo(
                q.name, q.num_layers, q.num_kv_heads, q.head_dim, q.dtype, q.fingerprint,
                q.num_tokens, segments.get(q.id, 0), clusters.get(q.id, 0),
                int(data.get(q.id) or 0), int(steady.get(q.id) or 0),
                int(tokens.get(q.id) or 0) * 2 * q.num_kv_heads * q.head_dim * item,
                q.created_at, q.updated_at))
        config = p.stored_config.to_dict()
    catalog_bytes = sum(os.path.getsize(f) for f in p.layout.root.iterdir()
                        if f.name.startswith(cat.path.name) and f.is_file())
    return StoreInfo(p.layout.root, store.schema_version, store.created_by, store.created_at,
                     config, infos, p.layout.disk_bytes(), catalog_bytes,
                     sum(q.raw_kv_bytes for q in infos))


def collect_garbage(p: Persistence, *, force: bool = False) -> GcReport:
    """Remove files under ``data/`` that no catalog row names, and empty directories
    of dropped sequences; then truncate the WAL. Files that may belong to commits the
    catalog lost (:mod:`vecstore.storage.orphans`) stay unless ``force``. The caller
    holds the write lock."""
    cat, layout = p.catalog, p.layout
    with sql_errors(cat.path), cat.session() as s, s.begin():
        named = set(s.scalars(select(FileRow.path)))
        live = set(s.scalars(select(SequenceRow.directory)))
    orphans = find_orphans(p.layout, p.catalog, named)
    doomed = orphans.leftovers + orphans.lost if force else orphans.leftovers
    removed, freed = [], 0
    for rel in sorted(doomed):
        path = layout.root / rel
        freed += path.stat().st_size
        path.unlink()
        removed.append(rel)
    if layout.data.is_dir():
        for entry in layout.data.iterdir():
            if entry.is_dir() and entry.name not in live and not any(entry.iterdir()):
                entry.rmdir()
                removed.append(layout.relative(entry) + "/")
    cat.checkpoint()
    return GcReport(removed, freed, [] if force else orphans.lost)
