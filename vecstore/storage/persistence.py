"""A store's directory: open or create it, read sequences' records and layers' data,
commit a transaction's changes durably. It takes and returns records
(:mod:`vecstore.storage.records`, :mod:`vecstore.catalog.records`); the engine builds its
sequences from them (:mod:`vecstore.engine.sequence_builder`).

A commit first writes every new segment as a new immutable file (temporary name,
fsync, rename, fsync of the directory), then records files, segments, clusters and
steady-zone chunks in one catalog transaction. A crash before the catalog commit
leaves only unnamed files (removed by ``gc``); after it, everything is on disk.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from vecstore.catalog.records import (
    Commit,
    FileRecord,
    LayerChange,
    LayerRecord,
    NewSegment,
    NewSequence,
    SequenceRecord,
)
from vecstore.checks import MAX_DIMENSION, SUPPORTED_DTYPES, check_device, parse_device
from vecstore.config import StoreConfig
from vecstore.errors import (
    BackendUnavailableError,
    CorruptionError,
    IncompatibleError,
    InvalidValueError,
    SequenceDroppedError,
)
from vecstore.index.base import INDEXES
from vecstore.storage.blame import map_checked
from vecstore.storage.codec import (
    SegmentShape,
    decode_chunks,
    decode_segment,
    encode_chunk,
    encode_segment,
)
from vecstore.storage.files import fsync_dir, make_dir, write_atomic
from vecstore.storage.opening import Opened, open_store
from vecstore.storage.orphans import mark_dropped
from vecstore.storage.oserrors import os_errors
from vecstore.storage.records import Changes, LayerWrite, LoadedLayer

__all__ = ["Persistence"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Persistence:
    """The on-disk side of one open store (catalog, lock, data files)."""

    def __init__(self, opened: Opened) -> None:
        self.layout = opened.layout
        self.catalog = opened.catalog
        self.stored_config = opened.stored
        self._lock = opened.lock
        self._opened = opened
        self._dirs: dict[str, str] = {}  # sequence name -> its directory under data/

    @property
    def read_only(self) -> bool:
        return self._lock is None

    # -- open ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: object, given: StoreConfig | None, *, read_only: bool,
             check_config: Callable[[StoreConfig], None]) -> tuple[Persistence, StoreConfig]:
        """Open (or, for a writer, create) the store at ``path``; returns it and the
        configuration to run with. ``check_config`` raises ConfigError for a config this
        vecstore cannot run (:func:`~vecstore.storage.opening.open_store`). A failed open
        changes nothing on disk."""
        opened = open_store(path, given, read_only=read_only, check_config=check_config)
        return cls(opened), given or opened.stored

    def discard(self) -> None:
        """Close, and remove whatever opening the store created (a store created by an
        open that then failed)."""
        self.close()
        self._opened.undo()

    def sequences(self) -> list[tuple[SequenceRecord, torch.dtype, torch.device]]:
        """The sequences of the catalog's snapshot, each with its dtype and device, checked
        (a row forged with a matching checksum may still hold values no sequence can
        have)."""
        out = []
        for rec in self.catalog.load():
            dtype, device = self._check_record(rec)
            if len(rec.layers) != rec.num_layers:
                raise CorruptionError(f"catalog {self.catalog.path} is corrupt: sequence "
                                      f"{rec.name!r} has {len(rec.layers)} layer rows, "
                                      f"expected {rec.num_layers}")
            self._dirs[rec.name] = rec.directory
            out.append((rec, dtype, device))
        return out

    def _check_record(self, rec: SequenceRecord) -> tuple[torch.dtype, torch.device]:
        """The dtype and device of a sequence row, checked."""
        bad = f"catalog {self.catalog.path} is corrupt: sequence {rec.name!r} records"
        if rec.dtype not in SUPPORTED_DTYPES:
            raise CorruptionError(f"{bad} dtype {rec.dtype!r}, not one of "
                                  f"{sorted(SUPPORTED_DTYPES)}")
        for what in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(rec, what)
            if not isinstance(value, int) or not 1 <= value <= MAX_DIMENSION:
                raise CorruptionError(f"{bad} {what} = {value!r}")
        try:
            device = parse_device(rec.device, "device")
        except InvalidValueError:
            raise CorruptionError(f"{bad} device {rec.device!r}") from None
        return SUPPORTED_DTYPES[rec.dtype], device

    def check_layer(self, rec: SequenceRecord, lr: LayerRecord, kind: str) -> None:
        """Check that ``lr`` was indexed with ``kind`` (the index the running config gives
        the layer).

        Raises
        ------
        CorruptionError
            The catalog names an unknown kind, or segments of another kind than the layer.
        IncompatibleError
            The layer was indexed with another kind than ``kind``.
        """
        built = {s.index_kind for s in lr.segments}
        if lr.index_kind not in INDEXES or (built and built != {lr.index_kind}):
            raise CorruptionError(
                f"catalog {self.catalog.path} is corrupt: sequence {rec.name!r} layer "
                f"{lr.layer} records index kind {lr.index_kind!r} but its segments "
                f"{sorted(built)}")
        if built and lr.index_kind != kind:
            raise IncompatibleError(
                f"sequence {rec.name!r} layer {lr.layer} was indexed with "
                f"{lr.index_kind!r} (stored), but the given config indexes it with {kind!r} "
                f"(layers.{lr.layer}.exact or index.kind); open with the stored settings")

    def load_layer(self, rec: SequenceRecord, lr: LayerRecord, dtype: torch.dtype,
                   device: torch.device) -> LoadedLayer:
        """Read (and checksum) the data files and steady chunks of layer ``lr`` of ``rec``
        onto ``device``."""
        H, D = rec.num_kv_heads, rec.head_dim
        try:
            check_device(device, "device")
        except BackendUnavailableError as exc:
            raise BackendUnavailableError(
                f"sequence {rec.name!r} lives on {device}, which this machine lacks ({exc}). "
                "Sequences on the store's executor.device follow the executor.device given "
                "at open: open with {'executor': {'device': 'cpu'}} to load them here") from None
        where = f"catalog {self.catalog.path}: sequence {rec.name!r} layer {lr.layer}"
        sk, sv = decode_chunks([c for c in lr.chunks if c.zone == "sink"], H, D, dtype, where)
        pk, pv = decode_chunks([c for c in lr.chunks if c.zone == "tail"], H, D, dtype, where)
        segments = []
        for s in lr.segments:
            path = self.layout.resolve(s.file.path)
            try:
                buf = map_checked(path, s.file, self.catalog.path)
            except FileNotFoundError:
                if not self.catalog.sequence_exists(rec.id):
                    raise SequenceDroppedError(
                        f"sequence {rec.name!r} was dropped by a writer after this store "
                        "was opened") from None
                raise CorruptionError(f"data file {path} is missing (sequence {rec.name!r} "
                                      f"layer {lr.layer} needs it)") from None
            seg = decode_segment(buf, str(path), SegmentShape(H, D, dtype, s.start, s.end,
                                                              s.num_units))
            if device.type != "cpu":
                # rows stay in the file mapping: the layer copies them into its KV tier
                # (the device, or pinned host memory) when it is first viewed
                seg = type(seg)(seg.start, seg.end, seg.keys, seg.values,
                                seg.offsets.to(device),
                                {k: v.to(device) for k, v in seg.meta.items()})
            segments.append(seg)
        total = sk.shape[1] + pk.shape[1] + sum(s.num_tokens for s in segments)
        if total != lr.num_tokens:
            raise CorruptionError(f"{where}: holds {total} tokens, the catalog recorded "
                                  f"{lr.num_tokens}")
        return LoadedLayer(sk.to(device), sv.to(device), pk.to(device), pv.to(device),
                           segments)

    # -- commit --------------------------------------------------------------------------
    def commit(self, changes: Changes, config: StoreConfig) -> None:
        """Make ``changes`` durable: data files first, then one catalog transaction.
        ``config`` is the running configuration (its index parameters are recorded)."""
        plan = Commit()
        written: list[Path] = []
        new_dirs: list[Path] = []
        dropping: list[Path] = []
        try:
            fresh: dict[str, str] = {}
            specs = {}
            for event in changes.events:
                if event.spec is not None:
                    fresh[event.name] = secrets.token_hex(8)
                    specs[event.name] = event.spec
                elif event.name in fresh:
                    del fresh[event.name]
                elif event.name in self._dirs:
                    plan.dropped.append(event.name)
                    dropping.append(self.layout.data / self._dirs[event.name])
            for name, directory in fresh.items():
                spec = specs[name]
                plan.created.append(NewSequence(
                    name, directory, spec.num_kv_heads, spec.head_dim, dtype_name(spec.dtype),
                    str(spec.device), spec.fingerprint, spec.index_kinds))
                new_dirs.append(self.layout.data / directory)
                with os_errors(self.layout.root, "commit to store"):
                    make_dir(new_dirs[-1])
            touched = set(fresh)
            for write in changes.layers:
                change = self._layer_change(config, write,
                                            fresh.get(write.name) or self._dirs[write.name],
                                            written)
                if change is not None:
                    plan.layers.append(change)
                    touched.add(write.name)
            plan.sequence_tokens = {name: changes.num_tokens[name] for name in touched}
            if plan.is_empty:
                return
            with os_errors(self.layout.root, "commit to store"):
                for d in {p.parent for p in written}:
                    fsync_dir(d)
            mark_dropped(dropping)
            gone = self.catalog.commit(plan)
        except BaseException:
            for p in written:
                p.unlink(missing_ok=True)
            for d in new_dirs:
                shutil.rmtree(d, ignore_errors=True)
            raise
        for event in changes.events:
            if event.spec is None:
                self._dirs.pop(event.name, None)
        self._dirs.update(fresh)
        for directory in gone:
            shutil.rmtree(self.layout.data / directory, ignore_errors=True)

    def _layer_change(self, cfg: StoreConfig, w: LayerWrite, directory: str,
                      written: list[Path]) -> LayerChange | None:
        params: dict[str, int | str] = {
            "tokens_per_cluster": cfg.index.tokens_per_cluster,
            "segment_tokens": cfg.index.segment_tokens, "kmeans_iters": cfg.index.kmeans_iters,
            "clusterer": cfg.cluster.kind, "seed": cfg.cluster.seed}
        change = LayerChange(w.name, w.layer, w.num_tokens)
        new_segments = w.segments[w.num_segments:]
        for s in new_segments:
            rel = self.layout.segment_file(directory, w.layer, s.start)
            rec = write_atomic(self.layout.root / rel, encode_segment(s))
            written.append(self.layout.root / rel)
            clusters = s.offsets.tolist() if "centroids" in s.meta else None
            change.segments.append(NewSegment(s.start, s.end, s.num_units, w.index_kind, params,
                                              FileRecord(rel, rec.size, rec.checksum), clusters))
        n_sink = w.sink_keys.shape[1]
        if n_sink > w.num_sink:
            change.sink = encode_chunk("sink", w.num_sink, w.sink_keys[:, w.num_sink:],
                                       w.sink_values[:, w.num_sink:])
        first = n_sink + w.num_indexed
        pending = w.pending_keys.shape[1]
        if new_segments:
            change.replace_tail = True
            if pending:
                change.tail = encode_chunk("tail", first, w.pending_keys, w.pending_values)
        elif pending > w.num_pending:
            change.tail = encode_chunk("tail", first + w.num_pending,
                                       w.pending_keys[:, w.num_pending:],
                                       w.pending_values[:, w.num_pending:])
        if not new_segments and change.sink is None and change.tail is None:
            return None
        return change

    def close(self) -> None:
        """Close the catalog and release the write lock; safe to call twice."""
        self.catalog.close()
        if self._lock is not None:
            self._lock.release()


