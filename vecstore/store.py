"""The Store: a database of sequences (KV caches) with a pluggable index and executor."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from vecstore.checks import check_device, check_new_sequence
from vecstore.config import StoreConfig, load_config
from vecstore.decoder import BatchDecoder
from vecstore.errors import (
    AlreadyExistsError,
    InvalidValueError,
    NotFoundError,
    ReadOnlyError,
    StoreClosedError,
)
from vecstore.executor.base import Executor, build_executor
from vecstore.index.base import INDEXES, Index
from vecstore.kvstore.placement import Placement
from vecstore.plugins import check_plugins
from vecstore.query_engine import QueryEngine
from vecstore.sequence import Sequence
from vecstore.storage.maintenance import GcReport, StoreInfo, collect_garbage, describe
from vecstore.storage.persistence import Persistence
from vecstore.storage.transaction import Transaction
from vecstore.storage.verify import VerifyReport, verify_store
from vecstore.types import QueryResult
from vecstore.writer import Writer

__all__ = ["Store"]


class Store:
    """A collection of sequences sharing one configuration.

    Open with :meth:`Store.open`: ``path=None`` gives an in-memory store, a directory
    path a persistent one (see ``docs/persistence.md``).

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

    def __init__(self, config: StoreConfig, path: Path | None = None, *,
                 persistence: Persistence | None = None) -> None:
        self.config = config
        self.path = path
        self._seqs: dict[str, Sequence] = {}
        self._indexes: dict[str, Index] = {}
        self._executor: Executor = build_executor(config)
        self._lock = threading.RLock()
        self._closed = False
        self._persistence = persistence
        self._txn: Transaction | None = None
        self._queries = QueryEngine(self, self._executor)
        self._writer = Writer(self, self._queries)
        self.placement = Placement(config.kvstore, retire_view=self._queries.retire)
        for kind in {config.index.kind, "flat"}:
            self._indexes[kind] = INDEXES.get(kind)(config)

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
        persistence, cfg = Persistence.open(path, given, read_only=read_only)
        try:
            store = cls(cfg, persistence.layout.root, persistence=persistence)
            store._seqs.update(persistence.attach(store))
            store.placement.check_fits(list(store._seqs.values()))
        except BaseException:
            persistence.discard()
            raise
        return store

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def is_read_only(self) -> bool:
        """Whether the store was opened with ``read_only=True``."""
        return self._persistence is not None and self._persistence.read_only

    def close(self) -> None:
        """Release the store (and its write lock); safe to call more than once.

        Changes of a transaction still open are discarded. The store forgets its sequences:
        one the caller still holds stays readable, and its KV is freed with it.
        """
        with self._lock:
            if not self._closed:
                self._queries.release_views()
                for seq in self._seqs.values():
                    seq.release(forget=False)
                # a closed store serves no sequence: its sequences (and their KV) then go
                # with their last outside reference, not with the next cyclic collection
                self._seqs.clear()
            self._closed = True
            if self._persistence is not None:
                self._persistence.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_open(self) -> None:
        """Raise :class:`StoreClosedError` if the store was closed."""
        if self._closed:
            raise StoreClosedError("the store is closed")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes (appends, creations, drops) into one atomic, durable commit.

        Outside a transaction every write commits on its own. Inside, nothing is
        written until the block ends; then everything commits at once (one fsync),
        or, if the block raised, everything is undone in memory. Nested blocks join
        the outermost one. The block holds the store's write lock, so other threads'
        writes wait for it.

        Examples
        --------
        >>> import torch
        >>> with Store.open() as store:
        ...     seq = store.create("a", num_layers=2, num_kv_heads=1, head_dim=4,
        ...                        dtype=torch.float32)
        ...     with store.transaction():  # one decode step, all layers
        ...         for layer in range(2):
        ...             seq.append(layer, torch.ones(1, 1, 4), torch.ones(1, 1, 4))
        ...     seq.num_tokens
        1
        """
        self.check_open()
        if self.is_read_only:
            raise ReadOnlyError(f"store {self.path} was opened read-only; open it without "
                                "read_only=True to write")
        with self._lock:
            if self._txn is not None:
                yield
                return
            txn = self._txn = Transaction()
            try:
                yield
                self.check_open()
                if self._persistence is not None:
                    self._persistence.commit(txn, self)
            except BaseException:
                txn.rollback(self._seqs)
                self._queries.release_views()
                raise
            finally:
                self._txn = None
            for kind, seq in txn.events:  # committed: a dropped sequence's memory goes back
                if kind == "drop" and seq.is_dropped:
                    seq.release()

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
        with self.transaction():
            if name in self._seqs:
                raise AlreadyExistsError(f"sequence {name!r} already exists")
            seq = Sequence(self, name, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=torch_dtype, device=dev,
                           fingerprint=fingerprint)
            self._seqs[name] = seq
            self._current_txn().created(seq)
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
        with self.transaction():
            seq = self.sequence(name)
            del self._seqs[name]
            seq.is_dropped = True
            self._queries.release_views()
            self._current_txn().dropped(seq)

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

    def _current_txn(self) -> Transaction:
        assert self._txn is not None  # only called inside self.transaction()
        return self._txn

    # -- data path -----------------------------------------------------------------------
    def index_kind(self, layer: int) -> str:
        """Name of the index serving ``layer`` (``flat`` for layers configured exact)."""
        return "flat" if self.config.for_layer(layer).exact else self.config.index.kind

    def index_for(self, layer: int) -> Index:
        """The index serving ``layer`` (``flat`` for layers configured exact)."""
        return self._indexes[self.index_kind(layer)]

    def append_tokens(self, seq: Sequence, layer: int, keys: torch.Tensor,
                      values: torch.Tensor, *, whole_segments: bool = False) -> None:
        """Append validated tokens (called by :meth:`Sequence.append`); durable when it
        returns, unless inside :meth:`transaction`. ``whole_segments``: a prefill chunk,
        indexed in whole ``index.segment_tokens`` segments only."""
        self._writer.append(seq, layer, keys, values, whole_segments=whole_segments)

    def append_batch(self, seqs: list[Sequence], layer: int, keys: torch.Tensor,
                     values: torch.Tensor, *, finite: bool = True,
                     whole_segments: bool = False) -> None:
        """Append row ``b`` of ``keys, values`` to ``seqs[b]``, every row in one transaction.

        The batched :meth:`Sequence.append` (a decode step of a batch): the arguments are
        checked once for all rows, and a failed check stores nothing.

        Parameters
        ----------
        seqs : list[Sequence]
            ``B`` sequences of this store with the same KV heads, head_dim, dtype and
            device of ``layer``.
        layer : int
            Layer index.
        keys, values : torch.Tensor
            ``[B, Hkv, T, D]``, ``T >= 1``, of the sequences' dtype.
        finite : bool
            Scan ``keys`` and ``values`` for NaN/Inf first (one host sync on a GPU;
            ``False``: the caller did).
        whole_segments : bool
            A prefill chunk: index only whole ``index.segment_tokens`` segments, so a
            prompt fed in chunks is segmented as configured; the rest stays in the tail
            until a later append (the first decode step's at the latest) indexes it.

        Raises
        ------
        ShapeError, InvalidValueError, SequenceDroppedError
            Before anything is stored.

        Examples
        --------
        >>> with Store.open() as store:
        ...     seqs = [store.create(n, num_layers=1, num_kv_heads=2, head_dim=8,
        ...                          dtype=torch.float32) for n in ("a", "b")]
        ...     store.append_batch(seqs, 0, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
        ...     [s.num_tokens for s in seqs]
        [3, 3]
        """
        self._writer.append_batch(seqs, layer, keys, values, finite=finite,
                                  whole_segments=whole_segments)

    def seal(self, seqs: list[Sequence], layer: int) -> None:
        """Index every pending token of ``layer`` of ``seqs`` but the last
        ``attention.window_tokens``, however few (appends index only every
        ``attention.update_tokens``), in one transaction. A prefill ends with it, so the
        rows of a batch decode with equally long steady zones.

        Examples
        --------
        >>> cfg = {"attention": {"sink_tokens": 2, "window_tokens": 4}}
        >>> with Store.open(config=cfg) as store:
        ...     seq = store.create("a", num_layers=1, num_kv_heads=1, head_dim=8,
        ...                        dtype=torch.float32)
        ...     seq.append(0, torch.randn(1, 40, 8), torch.randn(1, 40, 8))
        ...     before = seq.layers[0].num_indexed
        ...     store.seal([seq], 0)
        ...     before, seq.layers[0].num_indexed, seq.num_tokens
        (0, 34, 40)
        """
        self._writer.seal(seqs, layer)

    def check_query(self, seqs: list[Sequence], layer: int, q: object,
                    scale: float | None, *, finite: bool = True,
                    grouped: bool = True) -> tuple[torch.Tensor, float]:
        """Validate a batched query; returns ``q`` grouped ``[B, Hkv, G, L, D]`` (float32)
        and the scale. ``finite=False`` skips the NaN/Inf scan of ``q`` (a host sync on a
        device) for a caller that checked it already; ``grouped=False`` returns ``q`` as
        given (not converted)."""
        return self._queries.check(seqs, layer, q, scale, finite=finite, grouped=grouped)

    def query(self, seqs: list[Sequence], layer: int, q: torch.Tensor, *,
              scale: float | None = None, finite: bool | None = None) -> QueryResult:
        """Attention for a batch of sequences in one call.

        Parameters
        ----------
        seqs : list[Sequence]
            ``B`` sequences of this store with the same KV heads, head_dim, dtype, device.
        layer : int
            Layer index.
        q : torch.Tensor
            ``[B, Hq, L, D]`` queries; row ``b`` attends to every token of ``seqs[b]``.
        scale : float, optional
            Softmax scale, ``1/sqrt(D)`` by default.
        finite : bool, optional
            Scan ``q`` for NaN/Inf first and raise :class:`InvalidValueError`. ``None``
            (default): on CPU tensors only, where it costs nothing; on a GPU the scan makes
            the host wait for the device every query, so there a NaN in ``q`` gives NaN
            rows of ``out`` (the store is unchanged either way) unless ``finite=True``.

        Returns
        -------
        QueryResult
            ``out [B, Hq, L, D]``, ``lse [B, Hq, L]``, stats summed over the batch.
        """
        if finite is None:
            finite = not (isinstance(q, torch.Tensor) and q.device.type == "cuda")
        # the grouped float32 copy of q is for search(); the executors take q as given
        _, scale = self._queries.check(seqs, layer, q, scale, finite=finite, grouped=False)
        return self._queries.run(seqs, layer, q, scale)

    def decoder(self, seqs: list[Sequence], num_q_heads: int) -> BatchDecoder | None:
        """Fixed-shape decode steps of ``seqs`` over every layer, for one CUDA graph of a
        model's whole decode forward (:class:`~vecstore.decoder.BatchDecoder`), or ``None``
        when the batch does not qualify: the store is persisted (each step commits its
        tail), the executor is not the fused ``wave`` one or cannot run a layer, the rows'
        tails are not equally long behind full sinks (:meth:`seal` equalizes tails), or
        the next step indexes the tails. Rows that qualify share one steady buffer from
        then on. ``num_q_heads`` is the queries' head count.
        """
        return self._queries.decoder(seqs, num_q_heads)

    # -- memory --------------------------------------------------------------------------
    def memory(self) -> dict[str, tuple[int, int, int]]:
        """Bytes ``(in use, at peak, budget)`` of every memory budget in use, by name
        (``kvstore.pinned_budget_gb``, ``kvstore.gpu_budget_gb on <device>``; budget 0 =
        unbounded)."""
        return self.placement.usage()

