"""A directory's exact state (every name and every byte), to check that a failed call
changed nothing, and small tmpfs mounts for the tests that need a full or read-only
file system."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


def snapshot(root: Path) -> dict[str, bytes | None]:
    """``{relative path: bytes}`` of every file under ``root`` (``None`` for a directory,
    the target for a link); ``{}`` when ``root`` does not exist. The catalog's ``-shm``
    (SQLite's shared-memory index, rebuilt from the files by any reader) is left out."""
    if not os.path.lexists(root):
        return {}
    out: dict[str, bytes | None] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = os.readlink(p).encode()
            elif p.is_dir():
                out[rel] = None
            elif not name.endswith("-shm"):
                out[rel] = p.read_bytes()
    return out


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path | None]:
    """A tmpfs of ``size`` (``mount -o size=``) at ``where``, unmounted afterwards; yields
    ``None`` where this process may not mount (not root, or no ``CAP_SYS_ADMIN``)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          check=False, capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def remount(where: Path, options: str) -> None:
    """``mount -o remount,<options>`` (``ro``, ``rw``, ``size=...``)."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True,
                   capture_output=True)
