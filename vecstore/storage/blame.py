"""Which file is at fault when a data file and its catalog row disagree."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from vecstore.catalog.records import FileRecord
from vecstore.errors import CorruptionError
from vecstore.storage.codec import is_intact
from vecstore.storage.files import map_verified

__all__ = ["map_checked"]


def map_checked(path: Path, record: FileRecord, catalog: Path) -> mmap.mmap:
    """:func:`~vecstore.storage.files.map_verified`, blaming the catalog instead of the
    file when the file is whole by its own header (its row's size or checksum was
    altered).

    Raises
    ------
    CorruptionError
        Naming the data file, or ``catalog`` when the file vouches for itself.
    FileNotFoundError
        When the file is missing.
    """
    try:
        return map_verified(path, record)
    except CorruptionError:
        if not _vouches_for_itself(path):
            raise
        raise CorruptionError(
            f"catalog {catalog} is corrupt: its files row for data file {path} records "
            f"{record.size} bytes and checksum {record.checksum}, which the file does not "
            "match, yet the file is whole by the checksum in its own header: the row was "
            "altered, not the file") from None


def _vouches_for_itself(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                return False
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return bool(is_intact(mm))
    except OSError:
        return False
