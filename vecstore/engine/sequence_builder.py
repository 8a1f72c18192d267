"""How the engine assembles sequences: new ones, and reopened ones from the records
storage returns (their layers loading lazily)."""

from __future__ import annotations

from functools import partial

import torch

from vecstore.config import StoreConfig
from vecstore.engine.layer_indexes import LayerIndexes
from vecstore.engine.layer_state import LayerState
from vecstore.engine.lazy_layer import LazyLayer
from vecstore.engine.sequence import Sequence, SequenceOwner
from vecstore.kvstore.placement import Placement
from vecstore.storage.persistence import Persistence

__all__ = ["SequenceBuilder"]


class SequenceBuilder:
    """Builds the sequences of one store, their layers indexed, configured and placed as
    the store's."""

    def __init__(self, owner: SequenceOwner, config: StoreConfig, indexes: LayerIndexes,
                 placement: Placement) -> None:
        self._owner = owner
        self._config = config
        self._indexes = indexes
        self._placement = placement

    def new(self, name: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, device: torch.device, fingerprint: str | None) -> Sequence:
        """An empty sequence (arguments checked by the caller)."""
        layers = [LayerState(num_kv_heads, head_dim, dtype, device, self._indexes.index(layer),
                             self._config, placement=self._placement,
                             label=f"layer {layer} of sequence {name!r}")
                  for layer in range(num_layers)]
        return Sequence(self._owner, name, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        dtype=dtype, device=device, fingerprint=fingerprint, layers=layers)

    def reopened(self, persistence: Persistence) -> dict[str, Sequence]:
        """The sequences of ``persistence``'s catalog snapshot, by name; their layers read
        their data files when first used.

        Sequences stored on the store's stored ``executor.device`` follow the
        ``executor.device`` of the running config.
        """
        seqs = {}
        for rec, dtype, device in persistence.sequences():
            if rec.device == persistence.stored_config.executor.device:
                device = torch.device(self._config.executor.device)
            layers: list[LayerState] = []
            for lr in rec.layers:
                persistence.check_layer(rec, lr, self._indexes.kind(lr.layer))
                loader = partial(persistence.load_layer, rec, lr, dtype, device)
                layers.append(LazyLayer(
                    rec.num_kv_heads, rec.head_dim, dtype, device, self._indexes.index(lr.layer),
                    self._config, loader=loader, num_tokens=lr.num_tokens,
                    num_indexed=sum(s.end - s.start for s in lr.segments),
                    placement=self._placement,
                    label=f"layer {lr.layer} of sequence {rec.name!r}"))
            seqs[rec.name] = Sequence(self._owner, rec.name, num_kv_heads=rec.num_kv_heads,
                                      head_dim=rec.head_dim, dtype=dtype, device=device,
                                      fingerprint=rec.fingerprint, layers=layers)
        return seqs
