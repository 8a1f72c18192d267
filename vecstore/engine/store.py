"""The Store: a database of sequences (KV caches) with a pluggable index and executor."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vecstore.checks import check_device, check_new_sequence
from vecstore.config import StoreConfig, load_config
from vecstore.engine.sequence import Sequence
from vecstore.engine.store_data import StoreData
from vecstore.errors import AlreadyExistsError, InvalidValueError, NotFoundError, ReadOnlyError
from vecstore.plugins import check_plugins
from vecstore.storage.maintenance import GcReport, StoreInfo, collect_garbage, describe
from vecstore.storage.persistence import Persistence
from vecstore.storage.verify import VerifyReport, verify_store

__all__ = ["Store"]


class Store(StoreData):
    """A collection of sequences sharing one configuration.

    Open with :meth:`Store.open`: ``path=None`` gives an in-memory store, a directory
    path a persistent one (see ``docs/persistence.md``). This class holds opening, the
    sequences and maintenance; the data path (appends, queries) comes from
    :class:`~vecstore.engine.store_data.StoreData`, the lifecycle and transactions from
    :class:`~vecstore.engine.store_core.StoreCore`.

    Examples
    --------
    >>> import tempfile, torch
    >>> path = tempfile.mkdtemp()
    >>> with Store.open(path, config={"attention": {"retrieval_budget": 0.05}}) as store:
    ...     seq = store.create("a", num_layers=2, num_kv_heads=1, head_dim=4,
    ...                        dtype=torch.float32)
    ...     seq.append(0, torch.ones(1, 3, 4), torch.ones(1, 3, 4))
    >>> with Store.open(path, read_only=True) as store:
    ...     store.sequences(), store.sequence("a").tokens(0)
    (['a'], 3)
    """

    @classmethod
    def open(cls, path: str | Path | None = None,
             config: StoreConfig | Mapping[str, Any] | str | Path | None = None, *,
             read_only: bool = False) -> Store:
        """Open a store.

        Parameters
        ----------
        path : str | Path | None
            ``None`` for an in-memory store; else a directory: an existing store, or
            a new or empty directory to create one in. Any other directory is refused.
        config : StoreConfig | dict | str | Path | None
            Settings, a mapping of them, or a TOML file path. ``None`` means the
            defaults for a new store and the stored settings for an existing one.
            Settings fixed at creation (``StoreConfig.conflicts_with``) must match the
            stored ones; budgets, cache policy, window and executor may change.
        read_only : bool
            Open an existing store for reading only: no lock is taken, any number of
            readers may run beside the one writer, and each sees the store as last
            committed when it opened.

        Raises
        ------
        LockedError
            Another writer has the store open.
        IncompatibleError
            ``config`` conflicts with the stored settings (both values named).
        NotFoundError
            ``read_only`` and no store exists at ``path``.
        InvalidValueError
            ``path`` is malformed, a file, a non-empty directory that is no store, or
            unusable (a file as a component, a component too long, a loop of links).
        ConfigError
            ``config`` is invalid or names an unknown index, clusterer, executor or policy.
        StorageError
            The system refused (permissions, read-only media for a writer, a full disk).
        CorruptionError, SchemaVersionError, CatalogError
            The catalog is damaged, from an incompatible vecstore, or no vecstore catalog.

        A failed open leaves the directory exactly as it was.
        """
        if path is None:
            if read_only:
                raise InvalidValueError("read_only: only a store with a path can be opened "
                                        "read-only")
            cfg = load_config(config)
            check_plugins(cfg)
            return cls(cfg)
        given = None if config is None else load_config(config)
        if given is not None:
            check_plugins(given)
        persistence, cfg = Persistence.open(path, given, read_only=read_only,
                                            check_config=check_plugins)
        try:
            store = cls(cfg, persistence.layout.root, persistence=persistence)
            store._seqs.update(store._builder.reopened(persistence))
            store.placement.check_fits(
                [(state.device, state.num_indexed * _token_bytes(seq))
                 for seq in store._seqs.values() for state in seq.layers], len(store._seqs))
        except BaseException:
            persistence.discard()
            raise
        return store

    # -- catalog -------------------------------------------------------------------------
    def create(self, name: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype | str, device: str | torch.device | None = None,
               fingerprint: str | None = None) -> Sequence:
        """Create an empty sequence.

        Parameters
        ----------
        name : str
            1-128 characters of letters, digits, ``.``, ``_``, ``-``; starts with a
            letter or digit.
        num_layers, num_kv_heads, head_dim : int
            The model's attention shape, each 1 to 4096.
        dtype : torch.dtype | str
            ``float32``, ``float16`` or ``bfloat16``.
        device : str | torch.device, optional
            Where the sequence's tensors live: ``cpu``, ``cuda`` or ``cuda:N``
            (``executor.device`` by default).
        fingerprint : str, optional
            Identifies the model that produced the KV; integrations check it on reuse.

        Raises
        ------
        InvalidValueError
            A bad name, shape, dtype, fingerprint or device.
        BackendUnavailableError
            ``device`` is a CUDA device this machine lacks.
        AlreadyExistsError
            ``name`` is taken.
        """
        self.check_open()
        torch_dtype = check_new_sequence(
            name, {"num_layers": num_layers, "num_kv_heads": num_kv_heads,
                   "head_dim": head_dim}, fingerprint, dtype)
        dev = check_device(device if device is not None else self.config.executor.device,
                           "device")
        with self._write() as txn:
            if name in self._seqs:
                raise AlreadyExistsError(f"sequence {name!r} already exists")
            seq = self._builder.new(name, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, dtype=torch_dtype, device=dev,
                                    fingerprint=fingerprint)
            self._seqs[name] = seq
            txn.created(seq)
        return seq

    def sequence(self, name: str) -> Sequence:
        """The sequence called ``name``."""
        self.check_open()
        try:
            return self._seqs[name]
        except (KeyError, TypeError):
            raise NotFoundError(f"no sequence {name!r} in this store "
                                f"(it has {sorted(self._seqs)[:10]})") from None

    def sequences(self) -> list[str]:
        """Names of all sequences, sorted."""
        self.check_open()
        return sorted(self._seqs)

    def drop(self, name: str) -> None:
        """Delete a sequence and everything stored for it (its files too)."""
        with self._write() as txn:
            seq = self.sequence(name)
            del self._seqs[name]
            seq.is_dropped = True
            self._queries.release_views()
            txn.dropped(seq)

    # -- maintenance ---------------------------------------------------------------------
    def info(self) -> StoreInfo:
        """Sequences, segments, clusters, sizes and disk use of an on-disk store."""
        return describe(self._disk("info"))

    def verify(self, *, raise_on_error: bool = True) -> VerifyReport:
        """Check every data file's size and checksum and every catalog reference.

        Parameters
        ----------
        raise_on_error : bool
            Raise when a check fails (default); ``False`` returns the report with
            its ``problems`` instead.

        Raises
        ------
        CorruptionError
            Naming every bad file, if any check fails and ``raise_on_error``.
        """
        report = verify_store(self._disk("verify"))
        if raise_on_error:
            report.raise_if_bad()
        return report

    def gc(self, *, force: bool = False) -> GcReport:
        """Delete files under ``data/`` that no catalog row names (left by crashes or
        interrupted drops) and truncate the catalog's WAL. Needs a writer.

        Files newer than the catalog's last commit and its ``-wal`` may hold commits the
        catalog lost with its ``-wal`` file (``verify`` reports them); they are kept, and
        listed in :attr:`GcReport.kept`, unless ``force``.
        """
        with self._lock:
            disk = self._disk("gc")
            if disk.read_only:
                raise ReadOnlyError(f"gc: store {self.path} was opened read-only")
            return collect_garbage(disk, force=force)

    def _disk(self, what: str) -> Persistence:
        self.check_open()
        if self._persistence is None:
            raise InvalidValueError(f"{what}: an in-memory store has no files; open one "
                                    "with a path")
        return self._persistence


def _token_bytes(seq: Sequence) -> int:
    """Bytes of one token's key and value in one layer of ``seq``."""
    return 2 * seq.num_kv_heads * seq.head_dim * seq.dtype.itemsize
