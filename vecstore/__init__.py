"""vecstore: a KV cache built as a vector database for long-context LLM inference.

Open a :class:`Store`, create a :class:`Sequence` per context, ``append`` each layer's
keys and values, and ``query`` attention over them: exact over the steady zone and the
retrieved clusters, estimated over the rest, merged exactly by log-sum-exp.

The names below are imported on first use, so ``import vecstore.errors`` (and the
``vecstore`` command's ``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vecstore import errors as errors
    from vecstore.config import StoreConfig as StoreConfig
    from vecstore.engine.sequence import Sequence as Sequence
    from vecstore.engine.store import Store as Store
    from vecstore.types import QueryResult as QueryResult
    from vecstore.types import QueryStats as QueryStats
    from vecstore.types import SearchResult as SearchResult

    Config = StoreConfig

from vecstore.version import __version__ as __version__

__all__ = ["Config", "Store", "StoreConfig", "Sequence", "QueryResult", "QueryStats",
           "SearchResult", "errors", "__version__"]

_LAZY = {"Store": "vecstore.engine.store", "Sequence": "vecstore.engine.sequence",
         "StoreConfig": "vecstore.config", "Config": "vecstore.config",
         "QueryResult": "vecstore.types", "QueryStats": "vecstore.types",
         "SearchResult": "vecstore.types"}


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("vecstore.errors")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]),
                        "StoreConfig" if name == "Config" else name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vecstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
