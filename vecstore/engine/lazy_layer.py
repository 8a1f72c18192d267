"""A reopened layer that reads its data files (through a loader storage provides) only
when first used."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from vecstore.config import StoreConfig
from vecstore.engine.layer_lineage import new_lineage
from vecstore.engine.layer_state import LayerState
from vecstore.engine.tail import PendingTail
from vecstore.index.base import Index
from vecstore.kvstore.placement import Placement
from vecstore.storage.records import LoadedLayer

__all__ = ["LazyLayer"]


def _lazy(name: str) -> property:
    slot = f"_{name}"

    def get(self: LazyLayer) -> object:
        self.materialize()
        return getattr(self, slot)

    def put(self: LazyLayer, value: object) -> None:
        setattr(self, slot, value)

    return property(get, put, doc=f"``{name}``, loaded on first use.")


class LazyLayer(LayerState):
    """A :class:`LayerState` whose tensors come from ``loader`` on first access.

    Token counts are known from the catalog, so listing a store or checking a query's
    arguments reads no data file; the first ``query``, ``append`` or ``view`` of the
    layer loads (and checksums) its files.
    """

    sink_keys = _lazy("sink_keys")
    sink_values = _lazy("sink_values")
    segments = _lazy("segments")

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, index: Index, config: StoreConfig, *,
                 loader: Callable[[], LoadedLayer], num_tokens: int, num_indexed: int,
                 placement: Placement | None = None, label: str = "") -> None:
        self._loader: Callable[[], LoadedLayer] | None = loader
        self._load_lock = threading.Lock()
        self._counts = (num_tokens, num_indexed)
        super().__init__(num_kv_heads, head_dim, dtype, device, index, config,
                         placement=placement, label=label)

    @property
    def is_loaded(self) -> bool:
        """Whether the data files have been read."""
        return self._loader is None

    @property
    def num_tokens(self) -> int:
        return self._counts[0] if self._loader is not None else super().num_tokens

    @property
    def num_indexed(self) -> int:
        return self._counts[1] if self._loader is not None else super().num_indexed

    def _pending(self) -> PendingTail:
        self.materialize()
        return self._tail

    def materialize(self) -> None:
        """Load the layer now (a no-op once loaded); errors leave it unloaded."""
        if self._loader is None:
            return
        with self._load_lock:
            loader = self._loader
            if loader is None:
                return
            data = loader()
            self._sink_keys, self._sink_values = data.sink_keys, data.sink_values
            self._tail.set(data.pending_keys, data.pending_values)
            self._segments = data.segments
            self._loader = None
            self.version += 1  # the segments changed: counts and views are stale
            self.lineage = new_lineage()  # replaced, not appended to
