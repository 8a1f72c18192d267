"""SQLite connections for the catalog: pragmas, explicit transactions, error mapping."""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from vecstore.errors import (
    CatalogError,
    CorruptionError,
    LockedError,
    ReadOnlyError,
    StorageError,
    VecstoreError,
)

__all__ = ["BUSY_TIMEOUT_S", "make_engine", "sql_errors"]

BUSY_TIMEOUT_S = 10.0
"""How long a statement waits for another connection's lock before failing (a writer
checkpointing the WAL holds it for milliseconds)."""

# SQLite primary result codes (https://www.sqlite.org/rescode.html)
_BUSY, _LOCKED, _READONLY, _IOERR, _CORRUPT, _FULL, _CANTOPEN, _NOTADB = (
    5, 6, 8, 10, 11, 13, 14, 26)


def make_engine(path: Path, *, read_only: bool, immutable: bool = False) -> Engine:
    """An engine with one shared connection to ``path``.

    Writers use WAL mode with ``synchronous=FULL`` (a commit is on disk when it
    returns); readers open the file with ``mode=ro``, and ``immutable`` readers (read-only
    media, checks before a store is locked) read the main file alone and create no file.
    Foreign keys are on and every transaction starts with an explicit ``BEGIN``, so a read
    sees one snapshot.
    """

    def connect() -> sqlite3.Connection:
        if read_only:
            flags = "mode=ro&immutable=1" if immutable else "mode=ro"
            target, uri = f"file:{urllib.parse.quote(str(path))}?{flags}", True
        else:
            target, uri = str(path), False
        return sqlite3.connect(target, uri=uri, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)

    engine = create_engine("sqlite+pysqlite://", creator=connect, poolclass=StaticPool)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        # pysqlite must not issue BEGIN on its own (it skips it before SELECT)
        dbapi_connection.isolation_level = None
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        if not read_only:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


@contextmanager
def sql_errors(path: Path) -> Iterator[None]:
    """Turn SQLite failures into vecstore errors naming the catalog file."""
    try:
        yield
    except DBAPIError as exc:
        raise _translate(path, exc.orig or exc) from exc
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    except SQLAlchemyError as exc:
        raise CatalogError(f"catalog {path}: {exc}") from exc


def _translate(path: Path, exc: BaseException) -> VecstoreError:
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code in (_CORRUPT, _NOTADB) or "malformed" in str(exc) or "decode to UTF-8" in str(exc):
        return CorruptionError(f"catalog {path} is corrupt: {exc}")
    if code == _FULL:
        return StorageError(f"catalog {path}: the disk is full ({exc}); nothing was "
                            "committed: free space and retry")
    if code in (_IOERR, _CANTOPEN):
        return StorageError(f"catalog {path}: the system refused to read or write it "
                            f"({exc}); check the file's permissions and the device")
    if code in (_BUSY, _LOCKED):
        return LockedError(f"catalog {path} stayed locked for {BUSY_TIMEOUT_S:g} s: {exc}")
    if code == _READONLY:
        return ReadOnlyError(f"catalog {path} cannot be written: {exc}")
    return CatalogError(f"catalog {path}: {exc}")
