"""Connects a Store to its directory: open or create, load lazily, commit durably.

A commit first writes every new segment as a new immutable file (temporary name,
fsync, rename, fsync of the directory), then records files, segments, clusters and
steady-zone chunks in one catalog transaction. A crash before the catalog commit
leaves only unnamed files (removed by ``gc``); after it, everything is on disk.
"""

from __future__ import annotations

import secrets
import shutil
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

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
from vecstore.sequence import Sequence
from vecstore.storage.codec import (
    SegmentShape,
    decode_chunks,
    decode_segment,
    encode_chunk,
    encode_segment,
)
from vecstore.storage.blame import map_checked
from vecstore.storage.files import fsync_dir, make_dir, write_atomic
from vecstore.storage.lazy_layer import LazyLayer, LoadedLayer
from vecstore.storage.opening import Opened, open_store
from vecstore.storage.orphans import mark_dropped
from vecstore.storage.oserrors import os_errors
from vecstore.storage.transaction import LayerMark, Transaction

if TYPE_CHECKING:
    from vecstore.store import Store

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
        self._dirs: dict[Sequence, str] = {}

    @property
    def read_only(self) -> bool:
        return self._lock is None

    # -- open ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: object, given: StoreConfig | None, *,
             read_only: bool) -> tuple[Persistence, StoreConfig]:
        """Open (or, for a writer, create) the store at ``path``; returns it and the
        configuration to run with. A failed open changes nothing on disk."""
        opened = open_store(path, given, read_only=read_only)
        return cls(opened), given or opened.stored

    def discard(self) -> None:
        """Close, and remove whatever opening the store created (a store created by an
        open that then failed)."""
        self.close()
        self._opened.undo()

    def attach(self, store: Store) -> dict[str, Sequence]:
        """Sequences of the catalog's snapshot, their layers loading lazily."""
        seqs = {}
        for rec in self.catalog.load():
            dtype, device = self._check_record(rec)
            if rec.device == self.stored_config.executor.device:
                device = torch.device(store.config.executor.device)
            seq = Sequence(store, rec.name, num_layers=rec.num_layers,
                           num_kv_heads=rec.num_kv_heads, head_dim=rec.head_dim, dtype=dtype,
                           device=device, fingerprint=rec.fingerprint)
            if len(rec.layers) != rec.num_layers:
                raise CorruptionError(f"catalog {self.catalog.path} is corrupt: sequence "
                                      f"{rec.name!r} has {len(rec.layers)} layer rows, "
                                      f"expected {rec.num_layers}")
            seq.layers = [self._lazy_layer(store, rec, lr, dtype, device) for lr in rec.layers]
            self._dirs[seq] = rec.directory
            seqs[rec.name] = seq
        return seqs

    def _check_record(self, rec: SequenceRecord) -> tuple[torch.dtype, torch.device]:
        """The dtype and device of a sequence row, checked (a row forged with a matching
        checksum may still hold values no sequence can have)."""
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

    def _lazy_layer(self, store: Store, rec: SequenceRecord, lr: LayerRecord,
                    dtype: torch.dtype, device: torch.device) -> LazyLayer:
        kind = store.index_kind(lr.layer)
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
        loader = partial(self._load_layer, rec, lr, dtype, device)
        return LazyLayer(rec.num_kv_heads, rec.head_dim, dtype, device,
                         store.index_for(lr.layer), store.config, loader=loader,
                         num_tokens=lr.num_tokens,
                         num_indexed=sum(s.end - s.start for s in lr.segments),
                         placement=store.placement,
                         label=f"layer {lr.layer} of sequence {rec.name!r}")

    def _load_layer(self, rec: SequenceRecord, lr: LayerRecord, dtype: torch.dtype,
                    device: torch.device) -> LoadedLayer:
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
    def commit(self, txn: Transaction, store: Store) -> None:
        """Make ``txn`` durable: data files first, then one catalog transaction."""
        plan = Commit()
        written: list[Path] = []
        new_dirs: list[Path] = []
        dropping: list[Path] = []
        try:
            fresh: dict[Sequence, str] = {}
            for kind, seq in txn.events:
                if kind == "create":
                    fresh[seq] = secrets.token_hex(8)
                elif seq in fresh:
                    del fresh[seq]
                elif seq in self._dirs:
                    plan.dropped.append(seq.name)
                    dropping.append(self.layout.data / self._dirs[seq])
            for seq, directory in fresh.items():
                plan.created.append(NewSequence(
                    seq.name, directory, seq.num_kv_heads, seq.head_dim, dtype_name(seq.dtype),
                    str(seq.device), seq.fingerprint,
                    tuple(store.index_kind(i) for i in range(seq.num_layers))))
                new_dirs.append(self.layout.data / directory)
                with os_errors(self.layout.root, "commit to store"):
                    make_dir(new_dirs[-1])
            touched = set(fresh)
            for (seq, layer), mark in txn.marks.items():
                if seq.is_dropped:
                    continue
                change = self._layer_change(store, seq, layer, mark,
                                            fresh.get(seq) or self._dirs[seq], written)
                if change is not None:
                    plan.layers.append(change)
                    touched.add(seq)
            plan.sequence_tokens = {s.name: s.num_tokens for s in touched}
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
        for kind, seq in txn.events:
            if kind == "drop":
                self._dirs.pop(seq, None)
        self._dirs.update(fresh)
        for directory in gone:
            shutil.rmtree(self.layout.data / directory, ignore_errors=True)

    def _layer_change(self, store: Store, seq: Sequence, layer: int, mark: LayerMark,
                      directory: str, written: list[Path]) -> LayerChange | None:
        state = seq.layers[layer]
        cfg = store.config
        params: dict[str, int | str] = {
            "tokens_per_cluster": cfg.index.tokens_per_cluster,
            "segment_tokens": cfg.index.segment_tokens, "kmeans_iters": cfg.index.kmeans_iters,
            "clusterer": cfg.cluster.kind, "seed": cfg.cluster.seed}
        change = LayerChange(seq.name, layer, state.num_tokens)
        new_segments = state.segments[mark.num_segments:]
        for s in new_segments:
            rel = self.layout.segment_file(directory, layer, s.start)
            rec = write_atomic(self.layout.root / rel, encode_segment(s))
            written.append(self.layout.root / rel)
            clusters = s.offsets.tolist() if "centroids" in s.meta else None
            change.segments.append(NewSegment(s.start, s.end, s.num_units,
                                              store.index_kind(layer), params,
                                              FileRecord(rel, rec.size, rec.checksum), clusters))
        n_sink = state.sink_keys.shape[1]
        if n_sink > mark.num_sink:
            change.sink = encode_chunk("sink", mark.num_sink, state.sink_keys[:, mark.num_sink:],
                                       state.sink_values[:, mark.num_sink:])
        first = n_sink + state.num_indexed
        pending = state.pending_keys.shape[1]
        if new_segments:
            change.replace_tail = True
            if pending:
                change.tail = encode_chunk("tail", first, state.pending_keys,
                                           state.pending_values)
        elif pending > mark.num_pending:
            change.tail = encode_chunk("tail", first + mark.num_pending,
                                       state.pending_keys[:, mark.num_pending:],
                                       state.pending_values[:, mark.num_pending:])
        if not new_segments and change.sink is None and change.tail is None:
            return None
        return change

    def close(self) -> None:
        """Close the catalog and release the write lock; safe to call twice."""
        self.catalog.close()
        if self._lock is not None:
            self._lock.release()


