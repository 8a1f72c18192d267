"""What every store holds: its components, its lifecycle (open until closed) and its
transactions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from vecstore.config import StoreConfig
from vecstore.engine.layer_indexes import LayerIndexes
from vecstore.engine.query_engine import QueryEngine
from vecstore.engine.sequence import Sequence
from vecstore.engine.sequence_builder import SequenceBuilder
from vecstore.engine.transaction import Transaction
from vecstore.engine.writer import Writer
from vecstore.errors import ReadOnlyError, StoreClosedError
from vecstore.executor.base import Executor, build_executor
from vecstore.index.base import Index
from vecstore.kvstore.placement import Placement
from vecstore.storage.persistence import Persistence

__all__ = ["StoreCore"]


class StoreCore:
    """The components of a :class:`~vecstore.engine.store.Store` and its lifecycle and
    transactions; the store's data path and catalog of sequences build on it."""

    def __init__(self, config: StoreConfig, path: Path | None = None, *,
                 persistence: Persistence | None = None) -> None:
        self.config = config
        self.path = path
        self._seqs: dict[str, Sequence] = {}
        self._indexes = LayerIndexes(config)
        self._lock = threading.RLock()
        self._closed = False
        self._persistence = persistence
        self._txn: Transaction | None = None
        self.placement = Placement(config.kvstore)
        # wave buffers the executor builds charge kvstore.gpu_budget_gb up front
        self._executor: Executor = build_executor(config, self.placement.device_account)
        self._queries = QueryEngine(self, self._executor, config, self.placement, self._indexes,
                                    persistent=path is not None)
        self._writer = Writer(self._queries)
        self._builder = SequenceBuilder(self, config, self._indexes, self.placement)

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def is_read_only(self) -> bool:
        """Whether the store was opened with ``read_only=True``."""
        return self._persistence is not None and self._persistence.read_only

    @property
    def executor(self) -> Executor:
        """The executor the store's queries run on (``executor.kind``; ``"auto"`` resolved
        to the one it chose)."""
        return self._executor

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
                    self._queries.retire_replaced(seq.layers)
                # a closed store serves no sequence: its sequences (and their KV) then go
                # with their last outside reference, not with the next cyclic collection
                self._seqs.clear()
            self._closed = True
            if self._persistence is not None:
                self._persistence.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_open(self) -> None:
        """Raise :class:`StoreClosedError` if the store was closed."""
        if self._closed:
            raise StoreClosedError("the store is closed")

    # -- transactions --------------------------------------------------------------------
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
        >>> from vecstore import Store
        >>> with Store.open() as store:
        ...     seq = store.create("a", num_layers=2, num_kv_heads=1, head_dim=4,
        ...                        dtype=torch.float32)
        ...     with store.transaction():  # one decode step, all layers
        ...         for layer in range(2):
        ...             seq.append(layer, torch.ones(1, 1, 4), torch.ones(1, 1, 4))
        ...     seq.num_tokens
        1
        """
        with self._write():
            yield

    @contextmanager
    def _write(self) -> Iterator[Transaction]:
        """:meth:`transaction`, yielding the open :class:`Transaction` that writes record
        their changes in."""
        self.check_open()
        if self.is_read_only:
            raise ReadOnlyError(f"store {self.path} was opened read-only; open it without "
                                "read_only=True to write")
        with self._lock:
            if self._txn is not None:
                yield self._txn
                return
            txn = self._txn = Transaction()
            try:
                yield txn
                self.check_open()
                if self._persistence is not None:
                    self._persistence.commit(txn.changes(self._indexes), self.config)
            except BaseException:
                restored = txn.rollback(self._seqs)
                self._queries.release_views()
                self._queries.retire_replaced(restored)
                raise
            finally:
                self._txn = None
            for kind, seq in txn.events:  # committed: a dropped sequence's memory goes back
                if kind == "drop" and seq.is_dropped:
                    seq.release()
                    self._queries.retire_replaced(seq.layers)

    # -- indexes -------------------------------------------------------------------------
    def index_kind(self, layer: int) -> str:
        """Name of the index serving ``layer`` (``flat`` for layers configured exact)."""
        return self._indexes.kind(layer)

    def index_for(self, layer: int) -> Index:
        """The index serving ``layer`` (``flat`` for layers configured exact)."""
        return self._indexes.index(layer)
