"""Data files that no catalog row names, and which of them may hold committed data.

A commit writes its data files, then records them in one catalog transaction, which
SQLite appends to the catalog's ``-wal`` file. A file no row names is therefore either

- a *leftover*: written by a commit that never happened (a writer crashed or failed
  before its catalog transaction) or left by a drop whose deletion was cut short; safe
  to delete;
- or *lost*: its commit happened, but the ``-wal`` file holding that commit was lost or
  damaged after a crash, and the catalog fell back to an older state. Deleting it would
  destroy committed data.

A lost file is newer than the catalog's last commit, and older than the ``-wal`` (which
is missing, or recreated or damaged since: at the restart after the crash that lost it).
A leftover of a crashed commit is newer than the last commit too, and newer than the
``-wal``, or older by at most ``WAL_SLACK_S``: a writer killed inside its catalog
transaction has written the transaction's ``-wal`` frames, without the commit frame that
makes them count, just after its data files. Files of a drop are dated to the epoch before
the drop commits (:func:`mark_dropped`); older leftovers predate the last commit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

from vecstore.catalog.catalog import Catalog
from vecstore.storage.files import TMP_SUFFIX
from vecstore.storage.layout import StoreLayout

__all__ = ["Orphans", "find_orphans", "mark_dropped"]

CLOCK_SLACK_S = 0.01
"""File times come from a coarse kernel clock that may lag the catalog's by a tick."""

WAL_SLACK_S = 5.0
"""How much older than the ``-wal``'s last write a leftover may be: a commit's data files
are written just before its catalog transaction (milliseconds, seconds on a loaded
machine), while a ``-wal`` lost or damaged by a crash is rewritten after a restart. (The
crash test once saw a writer killed mid-transaction reported as a lost commit.)"""


@dataclass(frozen=True, slots=True)
class Orphans:
    """Files under ``data/`` (relative paths) that no catalog row names."""

    leftovers: list[str]
    lost: list[str]


def find_orphans(layout: StoreLayout, cat: Catalog, named: set[str]) -> Orphans:
    """The files under ``data/`` named neither in ``named`` (a snapshot's files) nor by
    the latest commit, split into leftovers and files of lost commits.

    Run beside a writer, the ``-wal`` is dated before the latest commit is read: a file
    committed in between is then named, and one still in flight is newer than the ``-wal``.
    """
    on_disk = [f for f in layout.data_files() if f not in named]
    wal = _mtime(layout.wal)
    latest = cat.file_paths()
    last = cat.last_commit().replace(tzinfo=UTC).timestamp() - CLOCK_SLACK_S
    leftovers, lost = [], []
    for rel in on_disk:
        if rel in latest:
            continue
        m = _mtime(layout.root / rel)
        if m is None:
            continue  # deleted meanwhile (a drop by the writer)
        newer = m > last and (wal is None or wal > m + WAL_SLACK_S)
        (lost if newer and not rel.endswith(TMP_SUFFIX) else leftovers).append(rel)
    return Orphans(leftovers, lost)


def mark_dropped(directories: list[Path]) -> None:
    """Date the files of sequences about to be dropped to the epoch, so that, left behind
    by a crash after the drop commits, they read as leftovers."""
    for d in directories:
        for f in d.glob("*"):
            try:
                os.utime(f, (0, 0))
            except OSError:
                pass  # left as it was: a gc after a crash would keep it as possibly lost


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except FileNotFoundError:
        return None
