"""The writer lock: an exclusive ``flock`` on ``<store>/LOCK``.

The kernel releases the lock when the holder's process ends, even by SIGKILL, so a
crashed writer never leaves a store locked. Readers take no lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from vecstore.errors import LockedError

__all__ = ["WriteLock"]


class WriteLock:
    """Hold the write lock of the store whose lock file is ``path``.

    Raises
    ------
    LockedError
        If another open writer (in any process, this one included) holds it.

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> lock = WriteLock(d / "LOCK")
    >>> try:
    ...     WriteLock(d / "LOCK")
    ... except LockedError:
    ...     print("locked")
    locked
    >>> lock.release()
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _locked(path) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    @staticmethod
    def check_free(path: Path) -> None:
        """Raise :class:`LockedError` if a writer holds ``path``; creates nothing."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(path) from None
        finally:
            os.close(fd)  # releases the probe's lock too

    def release(self) -> None:
        """Release the lock; safe to call twice."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _locked(path: Path) -> LockedError:
    try:
        with open(path, "rb") as fh:
            holder = fh.read(64).decode(errors="replace").strip() or "unknown"
    except OSError:
        holder = "unknown"
    return LockedError(f"store {path.parent} is already open for writing (process {holder} "
                       f"holds {path}); close that writer first. Readers may open the store "
                       "read-only beside it")
