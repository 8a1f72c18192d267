"""vecstore: a KV cache built as a vector database for long-context LLM inference.

Open a :class:`Store`, create a :class:`Sequence` per context, ``append`` each layer's
keys and values, and ``query`` attention over them: exact over the steady zone and the
retrieved clusters, estimated over the rest, merged exactly by log-sum-exp.
"""

from vecstore import errors as errors
from vecstore.config import StoreConfig as StoreConfig
from vecstore.sequence import Sequence as Sequence
from vecstore.store import Store as Store
from vecstore.types import QueryResult as QueryResult
from vecstore.types import QueryStats as QueryStats
from vecstore.types import SearchResult as SearchResult

Config = StoreConfig
__version__ = "0.1.0"

__all__ = ["Config", "Store", "StoreConfig", "Sequence", "QueryResult", "QueryStats",
           "SearchResult", "errors", "__version__"]
