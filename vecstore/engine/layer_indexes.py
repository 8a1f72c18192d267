"""Which index serves each layer of a store: the configured kind, or ``flat`` for layers
configured exact."""

from __future__ import annotations

from vecstore.config import StoreConfig
from vecstore.index.base import INDEXES, Index

__all__ = ["LayerIndexes"]


class LayerIndexes:
    """One instance of each index kind a configuration uses, looked up per layer.

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> indexes = LayerIndexes(StoreConfig.from_dict({"layers": {"0": {"exact": True}}}))
    >>> indexes.kind(0), indexes.kind(1)
    ('flat', 'wave')
    """

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._indexes: dict[str, Index] = {
            kind: INDEXES.get(kind)(config) for kind in {config.index.kind, "flat"}}

    def kind(self, layer: int) -> str:
        """Name of the index serving ``layer``."""
        return "flat" if self._config.for_layer(layer).exact else self._config.index.kind

    def index(self, layer: int) -> Index:
        """The index serving ``layer``."""
        return self._indexes[self.kind(layer)]
