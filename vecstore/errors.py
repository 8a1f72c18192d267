"""The one exception hierarchy of vecstore.

Every error a user can cause derives from :class:`VecstoreError`; most also derive
from the matching built-in (``ValueError``, ``LookupError``, ``RuntimeError``) so
that generic handlers keep working. Messages name the argument, what was expected
and what was received.
"""

from __future__ import annotations

__all__ = [
    "VecstoreError",
    "ConfigError",
    "ShapeError",
    "InvalidValueError",
    "AlreadyExistsError",
    "NotFoundError",
    "CatalogError",
    "SchemaVersionError",
    "CorruptionError",
    "LockedError",
    "ReadOnlyError",
    "StoreClosedError",
    "SequenceDroppedError",
    "BackendUnavailableError",
    "IncompatibleError",
    "CapacityError",
    "StorageError",
]


class VecstoreError(Exception):
    """Root of every error raised by vecstore."""


class ConfigError(VecstoreError, ValueError):
    """A configuration key is unknown or its value is out of range."""


class ShapeError(VecstoreError, ValueError):
    """A tensor has the wrong shape, dtype or device."""


class InvalidValueError(VecstoreError, ValueError):
    """An argument has a value that is not allowed (NaN/Inf, bad name, bad index)."""


class AlreadyExistsError(VecstoreError, ValueError):
    """An object with that name already exists."""


class NotFoundError(VecstoreError, LookupError):
    """No object with that name exists."""


class CatalogError(VecstoreError, RuntimeError):
    """The catalog cannot be read or written."""


class SchemaVersionError(CatalogError):
    """The catalog was written by an incompatible version of vecstore."""


class CorruptionError(CatalogError):
    """A data file or the catalog does not match what was committed."""


class LockedError(VecstoreError, RuntimeError):
    """Another process holds the store's write lock."""


class ReadOnlyError(VecstoreError, RuntimeError):
    """A write was attempted on a store opened read-only."""


class StoreClosedError(VecstoreError, RuntimeError):
    """The store was closed."""


class SequenceDroppedError(VecstoreError, RuntimeError):
    """The sequence was dropped from its store."""


class BackendUnavailableError(VecstoreError, RuntimeError):
    """A backend (cupy, faiss, triton, CUDA) is not installed or has no device."""


class IncompatibleError(VecstoreError, ValueError):
    """Stored state conflicts with what was asked (config, model fingerprint, shapes)."""


class CapacityError(VecstoreError, RuntimeError):
    """A configured memory budget is too small for the requested work."""


class StorageError(VecstoreError, OSError):
    """The operating system refused a store's file (disk full, permission denied,
    read-only media, I/O error); the message names the path, and what was being written
    is rolled back."""
