"""Operating-system failures on a store's files, as vecstore errors naming the path."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vecstore.errors import InvalidValueError, StorageError, VecstoreError

__all__ = ["os_errors", "translate", "is_writable_dir"]

_PATH = {
    errno.ENOTDIR: "a component of it is a file, not a directory",
    errno.ENAMETOOLONG: "it, or a component of it, is longer than the file system allows "
                        "(255 bytes per component on most)",
    errno.ELOOP: "it leads into a loop of symbolic links",
}
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def translate(exc: OSError, path: Path, doing: str, *,
              where: Path | None = None) -> VecstoreError:
    """The vecstore error for ``exc``, raised while ``doing`` something to ``path``; the
    message names ``where``, else the file the system named, else ``path``.

    A malformed path is an :class:`~vecstore.errors.InvalidValueError`; anything the
    system refused (space, permissions, read-only media, I/O) a
    :class:`~vecstore.errors.StorageError` with its ``errno``.

    Examples
    --------
    >>> err = translate(OSError(errno.ENOSPC, "No space left on device", "/s/data/x"),
    ...                 Path("/s"), "write segment")
    >>> type(err).__name__, err.errno
    ('StorageError', 28)
    >>> str(err).split(";")[0]
    'write segment /s/data/x: the disk is full (No space left on device)'
    """
    if where is None:
        where = Path(exc.filename) if isinstance(exc.filename, str) else path
    reason = exc.strerror or str(exc)
    if exc.errno in _PATH:
        return InvalidValueError(f"path: cannot use {path}: {_PATH[exc.errno]} ({reason})")
    if exc.errno in _FULL:
        msg = (f"{doing} {where}: the disk is full ({reason}); nothing was committed: free "
               "space and retry")
    elif exc.errno == errno.EROFS:
        msg = (f"{doing} {where}: the file system is read-only ({reason}); a writer needs "
               "writable media: open the store read-only to read it")
    elif exc.errno in (errno.EACCES, errno.EPERM):
        msg = (f"{doing} {where}: permission denied ({reason}); a writer needs write "
               "permission on the store directory and its files, a reader read permission")
    else:
        msg = f"{doing} {where}: {reason} (errno {exc.errno})"
    err = StorageError(msg)
    err.errno = exc.errno
    return err


@contextmanager
def os_errors(path: Path, doing: str) -> Iterator[None]:
    """Raise :func:`translate` of any ``OSError`` escaping the block (vecstore errors,
    which may derive from ``OSError``, pass through)."""
    try:
        yield
    except VecstoreError:
        raise
    except OSError as exc:
        raise translate(exc, path, doing) from exc


def is_writable_dir(path: Path) -> bool:
    """Whether files can be created in directory ``path`` (false on read-only media)."""
    return os.access(path, os.W_OK | os.X_OK)
