"""Durable file primitives: atomic writes, directory fsync, checksums, mapped reads."""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
from pathlib import Path

from vecstore.catalog.records import FileRecord
from vecstore.errors import CorruptionError, VecstoreError
from vecstore.storage.oserrors import translate

__all__ = ["checksum", "fsync_dir", "make_dir", "write_atomic", "map_verified", "TMP_SUFFIX"]

TMP_SUFFIX = ".tmp"
"""Suffix of files being written; never named by the catalog, so ``gc`` removes them."""


def checksum(*parts: bytes | bytearray | memoryview | mmap.mmap) -> str:
    """``"sha256:<hex>"`` of the concatenated ``parts``."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return f"sha256:{h.hexdigest()}"


def fsync_dir(path: Path) -> None:
    """Make renames and creations inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(path: Path) -> list[Path]:
    """Create directory ``path`` (parents included) and make its entry durable; returns
    the directories it created, outermost first."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    made = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # made meanwhile by another process
            continue
        made.append(d)
        fsync_dir(d.parent)
    return made


def write_atomic(path: Path, data: bytes) -> FileRecord:
    """Write ``data`` to ``path`` through a temporary file, fsync it and rename it.

    The caller fsyncs ``path.parent`` once for all files of a commit, before the
    catalog commit that names them. Returns the file's record (``path`` absolute).

    Raises
    ------
    StorageError
        Naming ``path`` when the system refuses (a full disk); nothing is left behind.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, VecstoreError):
            raise translate(exc, path.parent, "write data file", where=path) from exc
        raise
    return FileRecord(str(path), len(data), checksum(data))


def map_verified(path: Path, record: FileRecord) -> mmap.mmap:
    """Map ``path`` copy-on-write after checking its size and checksum against ``record``.

    Raises
    ------
    CorruptionError
        Naming the file, when its size or checksum differs from the catalog's.
    FileNotFoundError
        When the file is missing (the caller decides whether that is corruption).
    """
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size != record.size:
            raise CorruptionError(
                f"data file {path} is corrupt: {size} bytes, the catalog recorded "
                f"{record.size} (truncated or overwritten)")
        if size == 0:
            raise CorruptionError(f"data file {path} is corrupt: it is empty")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    actual = checksum(mm)
    if actual != record.checksum:
        mm.close()
        raise CorruptionError(
            f"data file {path} is corrupt: checksum {actual}, the catalog recorded "
            f"{record.checksum}")
    return mm
