"""Where a store keeps its files, and which directories may become or be a store.

::

    <store>/
        catalog.sqlite          the catalog, with catalog.sqlite-wal and -shm: SQLite keeps
                                them while the store is open and after a crash, and the
                                -wal then holds the latest commits (part of the store)
        LOCK                    held (flock) by the one writer
        data/<seq-dir>/<layer>-<start>.safetensors   one immutable file per segment

``<seq-dir>`` is a random hex name recorded in the catalog, never the sequence's own
name, so no user-supplied name ever becomes part of a path.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from vecstore.errors import CorruptionError, InvalidValueError, NotFoundError

__all__ = ["StoreLayout", "store_path"]

CATALOG = "catalog.sqlite"
LOCK = "LOCK"
DATA = "data"
_SCRATCH = (LOCK, f"{CATALOG}.tmp", f"{CATALOG}.tmp-journal", f"{CATALOG}.tmp-wal",
            f"{CATALOG}.tmp-shm")
_MAX_PATH = 4096


def store_path(path: object) -> Path:
    """Validate a user-supplied store path and make it absolute.

    Raises
    ------
    InvalidValueError
        For anything but a non-empty ``str``/``os.PathLike`` without NUL bytes.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidValueError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    raw = os.fspath(path)
    if not isinstance(raw, str) or not raw or "\x00" in raw or len(raw) > _MAX_PATH:
        raise InvalidValueError(f"path: expected a non-empty path without NUL bytes, of at "
                                f"most {_MAX_PATH} characters, got {raw!r:.80}")
    try:
        return Path(raw).expanduser().absolute()
    except RuntimeError as exc:  # "~user" of no user
        raise InvalidValueError(f"path: cannot expand {raw!r:.80} ({exc})") from None


@dataclass(frozen=True, slots=True)
class StoreLayout:
    """The files of the store at ``root``.

    Examples
    --------
    >>> layout = StoreLayout(Path("/stores/kv"))
    >>> layout.segment_file("9f2c", 3, 4)
    'data/9f2c/0003-000000000004.safetensors'
    >>> layout.resolve("data/9f2c/0003-000000000004.safetensors").parent.name
    '9f2c'
    """

    root: Path

    @property
    def catalog(self) -> Path:
        return self.root / CATALOG

    @property
    def catalog_tmp(self) -> Path:
        return self.root / f"{CATALOG}.tmp"

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def data(self) -> Path:
        return self.root / DATA

    @property
    def wal(self) -> Path:
        """The catalog's write-ahead log: part of the store whenever it exists (it holds
        the latest commits until a checkpoint folds them into the catalog)."""
        return self.root / f"{CATALOG}-wal"

    def is_store(self) -> bool:
        return self.catalog.is_file()

    def _kind(self) -> str:
        """``missing``, ``dir`` or ``file``; raises ``OSError`` for a path that cannot be
        looked up (a loop of links, a file as a component, a name too long)."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            if os.path.lexists(self.root):
                raise InvalidValueError(f"path: {self.root} is a symbolic link to nothing "
                                        f"({os.readlink(self.root)!r})") from None
            return "missing"
        return "dir" if stat.S_ISDIR(st.st_mode) else "file"

    def check_can_create(self) -> None:
        """Refuse a path that exists but is not (and cannot become) a store.

        Raises
        ------
        InvalidValueError
            If ``root`` is a file, or a non-empty directory without a catalog.
        """
        kind = self._kind()
        if kind == "file":
            raise InvalidValueError(f"path: {self.root} is a file, not a store directory")
        if kind == "dir" and not self.is_store():
            foreign = sorted(set(os.listdir(self.root)) - set(_SCRATCH))
            if foreign:
                raise InvalidValueError(
                    f"path: {self.root} is not a vecstore store (it has no {CATALOG}) and "
                    f"is not empty (it holds {foreign[:5]}); refusing to write into it. "
                    "Pass a new or empty directory.")

    def check_is_store(self) -> None:
        """Raise :class:`NotFoundError` unless ``root`` holds a catalog."""
        if self._kind() != "dir":
            raise NotFoundError(f"path: no store at {self.root} (no such directory)")
        if not self.is_store():
            raise NotFoundError(f"path: {self.root} is not a vecstore store (it has no "
                                f"{CATALOG})")

    def segment_file(self, directory: str, layer: int, start: int) -> str:
        """Relative path of the file of the segment starting at ``start``."""
        return f"{DATA}/{directory}/{layer:04d}-{start:012d}.safetensors"

    def resolve(self, rel: str) -> Path:
        """Absolute path of a catalog-recorded relative path, refusing any that would
        leave ``data/``.

        Raises
        ------
        CorruptionError
            If the recorded path is absolute or escapes the store.
        """
        p = PurePosixPath(rel)
        if (p.is_absolute() or not p.parts or p.parts[0] != DATA or ".." in p.parts
                or "\x00" in rel):
            raise CorruptionError(f"catalog {self.catalog} is corrupt: file path {rel!r} "
                                  "is outside the store's data directory")
        return self.root.joinpath(*p.parts)

    def relative(self, path: Path) -> str:
        """The POSIX form of ``path`` relative to the store."""
        return path.relative_to(self.root).as_posix()

    def data_files(self) -> list[str]:
        """Relative paths of every file under ``data/``, sorted."""
        if not self.data.is_dir():
            return []
        return sorted(self.relative(Path(d) / f) for d, _, files in os.walk(self.data)
                      for f in files)

    def disk_bytes(self) -> int:
        """Bytes used by every file of the store."""
        return sum(os.path.getsize(Path(d) / f) for d, _, files in os.walk(self.root)
                   for f in files)
