"""Opening a store's directory: every check first, writing nothing, then the lock and
whatever a new store needs. A failed open leaves the directory as it was.

Checks read the catalog *immutably* (its main file alone, creating no ``-wal``/``-shm``)
only when no ``-wal`` file exists, and a writer only once the lock is known to be free. With
a ``-wal`` the main file alone may be mid-checkpoint: a writer killed while folding the
``-wal`` in leaves pages of both versions there, which only the ``-wal`` makes whole again
(read alone it was "malformed" in a crash test). The checks then run on the catalog opened
through SQLite, and a failed open still removes what it created.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vecstore.catalog.catalog import Catalog
from vecstore.config import StoreConfig
from vecstore.errors import CatalogError, ConfigError, IncompatibleError, StorageError
from vecstore.storage.files import fsync_dir, make_dir
from vecstore.storage.layout import StoreLayout, store_path
from vecstore.storage.lock import WriteLock
from vecstore.storage.oserrors import is_writable_dir, os_errors

__all__ = ["Opened", "open_store"]


@dataclass
class Opened:
    """What :func:`open_store` opened, and what it created (to undo a failed open)."""

    layout: StoreLayout
    catalog: Catalog
    lock: WriteLock | None
    stored: StoreConfig
    created: list[Path] = field(default_factory=list)

    def undo(self) -> None:
        """Remove what this open created (after the catalog and lock are closed)."""
        _remove(self.created)
        self.created.clear()


def _remove(created: list[Path]) -> None:
    for path in reversed(created):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            for p in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm"))):
                p.unlink(missing_ok=True)


CheckConfig = Callable[[StoreConfig], None]
"""Raises :class:`~vecstore.errors.ConfigError` for a config this vecstore cannot run (one
naming an unregistered plug-in: :func:`vecstore.plugins.check_plugins`)."""


def open_store(path: object, given: StoreConfig | None, *, read_only: bool,
               check_config: CheckConfig) -> Opened:
    """Open (or, for a writer, create) the store at ``path``; ``check_config`` checks a new
    store's config and the stored one.

    Raises
    ------
    InvalidValueError, NotFoundError, LockedError, IncompatibleError, CatalogError, StorageError
        Before anything in the directory changed.
    """
    layout = StoreLayout(store_path(path))
    with os_errors(layout.root, "open store"):
        return (_open_reader(layout, given, check_config) if read_only
                else _open_writer(layout, given, check_config))


def _open_reader(layout: StoreLayout, given: StoreConfig | None,
                 check_config: CheckConfig) -> Opened:
    layout.check_is_store()
    has_wal = layout.wal.exists()
    if not has_wal:
        _inspect(layout, given, check_config)
    immutable = not is_writable_dir(layout.root) and (not has_wal or
                                                      layout.wal.stat().st_size == 0)
    try:
        catalog = Catalog.open(layout.catalog, read_only=True, immutable=immutable)
    except StorageError as exc:
        if is_writable_dir(layout.root):
            raise
        raise StorageError(
            f"{exc}. {layout.root} is read-only and its catalog's -wal file holds commits "
            "not yet folded into the catalog: open the store once with a writer on writable "
            "media (that folds them in), or copy it to writable media") from exc
    try:
        stored = checked_config(catalog, given, layout, check_config)
    except BaseException:
        catalog.close()
        raise
    return Opened(layout, catalog, None, stored)


def _open_writer(layout: StoreLayout, given: StoreConfig | None,
                 check_config: CheckConfig) -> Opened:
    layout.check_can_create()
    if layout.is_store():
        WriteLock.check_free(layout.lock)
        if not layout.wal.exists():
            _inspect(layout, given, check_config)
    created: list[Path] = []
    lock, catalog = None, None
    try:
        created += make_dir(layout.root)
        had_lock = layout.lock.exists()
        lock = WriteLock(layout.lock)
        if not had_lock:
            created.append(layout.lock)
        if not layout.is_store():
            layout.check_can_create()
            config = given or StoreConfig()
            check_config(config)
            created.append(layout.catalog)
            _initialize(layout, config.to_dict())
        created += make_dir(layout.data)
        catalog = Catalog.open(layout.catalog, read_only=False)
        stored = checked_config(catalog, given, layout, check_config)
    except BaseException:
        if catalog is not None:
            catalog.close()
        if lock is not None:
            lock.release()
        _remove(created)
        raise
    return Opened(layout, catalog, lock, stored, created)


def _inspect(layout: StoreLayout, given: StoreConfig | None,
             check_config: CheckConfig) -> None:
    """Check the catalog and ``given`` against it, creating no file."""
    catalog = Catalog.open(layout.catalog, read_only=True, immutable=True)
    try:
        checked_config(catalog, given, layout, check_config)
    finally:
        catalog.close()


def checked_config(catalog: Catalog, given: StoreConfig | None, layout: StoreLayout,
                   check_config: CheckConfig) -> StoreConfig:
    """The catalog's stored config, after checking that ``given`` agrees with it.

    Raises
    ------
    CatalogError
        The stored config is not one this vecstore can run.
    IncompatibleError
        ``given`` changes a setting fixed at creation (both values named).
    """
    try:
        stored = StoreConfig.from_dict(catalog.config)
        check_config(stored)
    except ConfigError as exc:
        raise CatalogError(f"catalog {catalog.path}: its stored config cannot be read by "
                           f"this vecstore ({exc})") from None
    if given is not None:
        conflicts = given.conflicts_with(stored)
        if conflicts:
            raise IncompatibleError(
                f"config conflicts with the store at {layout.root}: "
                f"{'; '.join(conflicts)}. These settings are fixed when a store is "
                "created; open it with config=None to use the stored ones")
    return stored


def _initialize(layout: StoreLayout, config: dict[str, object]) -> None:
    tmp = layout.catalog_tmp
    for leftover in (tmp, *(tmp.with_name(tmp.name + s) for s in ("-journal", "-wal", "-shm"))):
        leftover.unlink(missing_ok=True)
    try:
        Catalog.initialize(tmp, config)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, layout.catalog)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(layout.root)
