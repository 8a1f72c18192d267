"""``verify``: every checksum, every catalog reference, every count, in one snapshot."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from vecstore.catalog.connections import sql_errors
from vecstore.catalog.records import ChunkRecord, FileRecord
from vecstore.catalog.schema import (
    ClusterRow,
    FileRow,
    LayerRow,
    SegmentRow,
    SequenceRow,
    SteadyChunkRow,
    StoreRow,
    sequence_checksum,
    text_checksum,
)
from vecstore.checks import SUPPORTED_DTYPES
from vecstore.errors import CorruptionError
from vecstore.index.base import INDEXES
from vecstore.storage.blame import map_checked
from vecstore.storage.codec import SegmentShape, decode_chunks, decode_segment
from vecstore.storage.orphans import find_orphans
from vecstore.storage.persistence import Persistence

__all__ = ["VerifyReport", "verify_store"]


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :meth:`vecstore.Store.verify` checked and found.

    Attributes
    ----------
    path : Path
        The store.
    files_checked, bytes_checked : int
        Data files the catalog names (missing and bad ones included), and the bytes
        read from them.
    segments, clusters, chunks : int
        Catalog rows cross-checked against the files.
    problems : list[str]
        One line per failed check, each naming the bad file.
    unreferenced : list[str]
        Files under ``data/`` that no catalog row names (left by a crash or an
        interrupted drop; harmless, removed by ``gc``).
    lost : list[str]
        Files no catalog row names that are newer than the catalog's last commit and
        than its ``-wal`` file: data of commits the catalog lost with its ``-wal`` (see
        :mod:`vecstore.storage.orphans`). They fail verification, and ``gc`` keeps them
        unless forced.

    Examples
    --------
    >>> import tempfile
    >>> from vecstore import Store
    >>> with Store.open(tempfile.mkdtemp()) as store:
    ...     report = store.verify()
    >>> report.ok, report.files_checked
    (True, 0)
    """

    path: Path
    files_checked: int
    bytes_checked: int
    segments: int
    clusters: int
    chunks: int
    problems: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.lost

    def raise_if_bad(self) -> None:
        """Raise :class:`CorruptionError` listing every problem, if there is any."""
        if not self.ok:
            raise CorruptionError(f"store {self.path} failed verification:\n  "
                                  + "\n  ".join(self.problems + self._lost_lines()))

    def _lost_lines(self) -> list[str]:
        if not self.lost:
            return []
        return [f"data file {self.path / f} is named by no catalog row but is newer than the "
                "catalog's last commit and its -wal file" for f in self.lost] + [
            f"the catalog's -wal file ({self.path / 'catalog.sqlite-wal'}) was probably "
            "lost or damaged after a crash, taking the commits that named these files: "
            "restore it from where the store was copied; if instead a writer crashed "
            "mid-commit and reopened without committing, they are leftovers (gc --force "
            "removes them)"]

    def summary(self) -> str:
        """A few human-readable lines."""
        head = (f"{'ok' if self.ok else 'FAILED'}: {self.files_checked} files "
                f"({self.bytes_checked / 2**20:.1f} MiB), {self.segments} segments, "
                f"{self.clusters} clusters, {self.chunks} steady chunks checked")
        lines = [head, *(f"problem: {p}" for p in self.problems + self._lost_lines())]
        lines += [f"unreferenced (run gc): {u}" for u in self.unreferenced]
        return "\n".join(lines)


def verify_store(p: Persistence) -> VerifyReport:
    """Check the store behind ``p`` from one catalog snapshot; never raises for a
    problem it can describe (see :attr:`VerifyReport.problems`)."""
    cat, layout = p.catalog, p.layout
    problems: list[str] = []
    with sql_errors(cat.path), cat.session() as s, s.begin():
        problems += [f"catalog {cat.path}: integrity_check: {m}" for m in
                     s.execute(text("PRAGMA integrity_check")).scalars().all() if m != "ok"]
        fk = s.execute(text("PRAGMA foreign_key_check")).all()
        if fk:
            problems.append(f"catalog {cat.path}: {len(fk)} rows reference missing rows "
                            f"(first: {tuple(fk[0])})")
        store = s.scalars(select(StoreRow)).one()
        if text_checksum(store.config_json) != store.config_checksum:
            problems.append(f"catalog {cat.path}: the stored config fails its checksum")
        seqs = {r.id: r for r in s.scalars(select(SequenceRow))}
        problems += [f"catalog {cat.path}: the row of sequence {q.id} ({q.name!r}) fails its "
                     "checksum" for q in seqs.values() if sequence_checksum(q) != q.checksum]
        layers = {r.id: r for r in s.scalars(select(LayerRow))}
        files = {r.id: r for r in s.scalars(select(FileRow))}
        segs = s.scalars(select(SegmentRow).order_by(SegmentRow.layer_id,
                                                     SegmentRow.start)).all()
        chunks = list(s.scalars(select(SteadyChunkRow).order_by(
            SteadyChunkRow.layer_id, SteadyChunkRow.zone, SteadyChunkRow.first_token)))
        tokens: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        sinks: dict[int, int] = defaultdict(int)
        for c in chunks:
            sinks[c.layer_id] += c.num_tokens if c.zone == "sink" else 0
        checked_bytes, num_clusters, named = 0, 0, set()
        missing: list[tuple[int, str]] = []  # (sequence id, problem): dropped meanwhile?
        for seg in segs:
            lr, f = layers.get(seg.layer_id), files.get(seg.file_id)
            if lr is None or f is None or lr.sequence_id not in seqs:
                problems.append(f"catalog {cat.path}: segment {seg.id} names a missing "
                                "layer, file or sequence")
                continue
            named.add(f.id)
            q = seqs[lr.sequence_id]
            where = f"sequence {q.name!r} layer {lr.layer} segment [{seg.start}, {seg.end})"
            if seg.index_kind != lr.index_kind or lr.index_kind not in INDEXES:
                problems.append(f"catalog {cat.path}: {where} records index kind "
                                f"{seg.index_kind!r}, its layer {lr.index_kind!r}")
            n, clusters, gone = _check_segment(s, p, q, seg, f, where, problems)
            if gone is not None:
                missing.append((q.id, gone))
            checked_bytes += n
            num_clusters += clusters
            if seg.start != sinks[lr.id] + tokens[lr.id]["indexed"]:
                problems.append(f"catalog {cat.path}: {where} does not follow the previous "
                                "segment")
            tokens[lr.id]["indexed"] += seg.end - seg.start
        problems += [f"catalog {cat.path}: file row {f.path!r} names no segment"
                     for i, f in files.items() if i not in named]
        _check_chunks(p, seqs, layers, chunks, tokens, problems)
        _check_counts(p, seqs, layers, tokens, problems)
    # beside a writer: a file of a sequence dropped since the snapshot may be gone
    problems += [msg for seq_id, msg in missing if cat.sequence_exists(seq_id)]
    orphans = find_orphans(p.layout, p.catalog, {f.path for f in files.values()})
    return VerifyReport(layout.root, len(named), checked_bytes, len(segs), num_clusters,
                        len(chunks), problems, orphans.leftovers, orphans.lost)


def _check_segment(s: Session, p: Persistence, q: SequenceRow, seg: SegmentRow, f: FileRow,
                   where: str, problems: list[str]) -> tuple[int, int, str | None]:
    """Check one segment's file and cluster rows; returns the bytes read, the cluster
    rows, and the problem of a missing file (reported unless the sequence was dropped)."""
    rows = s.execute(select(ClusterRow.head, ClusterRow.unit, ClusterRow.row_start,
                            ClusterRow.size).where(ClusterRow.segment_id == seg.id)
                     .order_by(ClusterRow.head, ClusterRow.unit)).all()
    size = 0
    try:
        path = p.layout.resolve(f.path)
        size = path.stat().st_size
        buf = map_checked(path, FileRecord(f.path, f.size, f.checksum), p.catalog.path)
        decoded = decode_segment(buf, str(path), SegmentShape(
            q.num_kv_heads, q.head_dim, SUPPORTED_DTYPES.get(q.dtype, torch.float32),
            seg.start, seg.end, seg.num_units))
    except FileNotFoundError:
        return 0, len(rows), f"data file {p.layout.root / f.path} is missing ({where})"
    except CorruptionError as exc:
        problems.append(f"{exc} ({where})")
        return size, len(rows), None
    offsets = decoded.offsets
    if "centroids" in decoded.meta:
        H, U = offsets.shape[0], offsets.shape[1] - 1
        want = torch.stack([torch.arange(H).repeat_interleave(U), torch.arange(U).repeat(H),
                            offsets[:, :-1].reshape(-1), offsets.diff().reshape(-1)], dim=1)
        got = torch.tensor([tuple(r) for r in rows], dtype=torch.long).reshape(-1, 4)
        if got.shape != want.shape or not torch.equal(got, want):
            problems.append(f"catalog {p.catalog.path}: cluster rows of {where} disagree with "
                            f"data file {p.layout.root / f.path}")
    elif rows:
        problems.append(f"catalog {p.catalog.path}: {where} is not clustered but has "
                        f"{len(rows)} cluster rows")
    return size, len(rows), None


def _check_chunks(p: Persistence, seqs: dict[int, SequenceRow], layers: dict[int, LayerRow],
                  chunks: list[SteadyChunkRow], tokens: dict[int, dict[str, int]],
                  problems: list[str]) -> None:
    for c in chunks:
        lr = layers.get(c.layer_id)
        if lr is None or lr.sequence_id not in seqs:
            problems.append(f"catalog {p.catalog.path}: steady chunk {c.id} names a missing "
                            "layer")
            continue
        q = seqs[lr.sequence_id]
        t = tokens[lr.id]
        expected = t["sink"] if c.zone == "sink" else t["sink"] + t["indexed"] + t["tail"]
        where = f"catalog {p.catalog.path}: sequence {q.name!r} layer {lr.layer}"
        if c.zone not in ("sink", "tail") or c.first_token != expected:
            problems.append(f"{where}: steady chunk at token {c.first_token} ({c.zone}) does "
                            f"not follow the previous one (expected token {expected})")
        try:
            decode_chunks([ChunkRecord(c.zone, c.first_token, c.num_tokens, c.keys, c.values,
                                       c.checksum)], q.num_kv_heads, q.head_dim,
                          SUPPORTED_DTYPES.get(q.dtype, torch.float32), where)
        except CorruptionError as exc:
            problems.append(str(exc))
        t[c.zone] += c.num_tokens


def _check_counts(p: Persistence, seqs: dict[int, SequenceRow], layers: dict[int, LayerRow],
                  tokens: dict[int, dict[str, int]], problems: list[str]) -> None:
    per_seq: dict[int, list[LayerRow]] = defaultdict(list)
    for lr in layers.values():
        per_seq[lr.sequence_id].append(lr)
        t = tokens[lr.id]
        held = t["sink"] + t["indexed"] + t["tail"]
        if held != lr.num_tokens:
            name = seqs[lr.sequence_id].name if lr.sequence_id in seqs else lr.sequence_id
            problems.append(f"catalog {p.catalog.path}: sequence {name!r} layer {lr.layer} "
                            f"holds {held} tokens but records {lr.num_tokens}")
    for q in seqs.values():
        rows = sorted(per_seq[q.id], key=lambda r: r.layer)
        if [r.layer for r in rows] != list(range(q.num_layers)):
            problems.append(f"catalog {p.catalog.path}: sequence {q.name!r} should have layers "
                            f"0..{q.num_layers - 1}, has {[r.layer for r in rows][:8]}")
        elif q.num_tokens != rows[0].num_tokens:
            problems.append(f"catalog {p.catalog.path}: sequence {q.name!r} records "
                            f"{q.num_tokens} tokens, its layer 0 holds {rows[0].num_tokens}")
        if q.dtype not in SUPPORTED_DTYPES:
            problems.append(f"catalog {p.catalog.path}: sequence {q.name!r} has unknown dtype "
                            f"{q.dtype!r}")
