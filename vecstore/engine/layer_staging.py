"""An append to one layer worked out before anything changes: :class:`StagedAppend`.

What an append (or a seal) does to a layer follows from the layer's steady zone, how many
tokens it has indexed and the settings: the new tokens fill the sinks first, the rest join
the tail, and all but the tail's last ``window_tokens`` are indexed once at least
``update_tokens`` are ready (whole ``index.segment_tokens`` segments of them for a prefill
chunk). Staging computes that without touching the layer, so a batch's rows can be built
together (:mod:`vecstore.engine.batch_build`) and committed one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vecstore.config import StoreConfig

__all__ = ["StagedAppend"]

Pair = tuple[torch.Tensor, torch.Tensor]
"""``[Hkv, n, D]`` keys and values."""


@dataclass(frozen=True, slots=True)
class StagedAppend:
    """A layer's steady zone after an append (:meth:`LayerState.stage
    <vecstore.engine.layer_state.LayerState.stage>`), and how many of its tail's first
    tokens the append indexes.

    Attributes
    ----------
    sink_keys, sink_values : torch.Tensor
        ``[Hkv, S, D]`` sinks after the append.
    pending_keys, pending_values : torch.Tensor
        ``[Hkv, T, D]`` the tail after the append, its first ``ready`` tokens still in it.
    ready : int
        Tail tokens to index now (0: none).
    start : int
        Position of the first of them.

    Examples
    --------
    >>> config = StoreConfig.from_dict({"attention": {"sink_tokens": 2, "window_tokens": 4,
    ...                                               "update_tokens": 8}})
    >>> empty = (torch.zeros(1, 0, 8), torch.zeros(1, 0, 8))
    >>> new = torch.randn(1, 20, 8)
    >>> staged = StagedAppend.appending(config, empty, empty, 0, new, new)
    >>> staged.sink_keys.shape[1], staged.pending_keys.shape[1], staged.ready, staged.start
    (2, 18, 14, 2)
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    pending_keys: torch.Tensor
    pending_values: torch.Tensor
    ready: int
    start: int

    @classmethod
    def appending(cls, config: StoreConfig, sinks: Pair, tail: Pair, num_indexed: int,
                  keys: torch.Tensor, values: torch.Tensor, *,
                  whole_segments: bool = False) -> StagedAppend:
        """``keys``, ``values`` appended to a layer of ``sinks``, ``tail`` and
        ``num_indexed`` indexed tokens."""
        a = config.attention
        sink_keys, sink_values = sinks
        room = a.sink_tokens - sink_keys.shape[1]
        if room > 0:
            sink_keys = torch.cat([sink_keys, keys[:, :room]], dim=1)
            sink_values = torch.cat([sink_values, values[:, :room]], dim=1)
            keys, values = keys[:, room:], values[:, room:]
        tail = (torch.cat([tail[0], keys], dim=1), torch.cat([tail[1], values], dim=1))
        return cls._indexing(config, (sink_keys, sink_values), tail, num_indexed,
                             a.update_tokens, whole_segments)

    @classmethod
    def sealing(cls, config: StoreConfig, sinks: Pair, tail: Pair,
                num_indexed: int) -> StagedAppend:
        """A layer's tail indexed now but for its last ``window_tokens``, however few."""
        return cls._indexing(config, sinks, tail, num_indexed, 1, False)

    @classmethod
    def _indexing(cls, config: StoreConfig, sinks: Pair, tail: Pair, num_indexed: int,
                  at_least: int, whole_segments: bool) -> StagedAppend:
        """All but the last ``window_tokens`` of ``tail`` ready to index (only whole
        ``index.segment_tokens`` segments of them, with ``whole_segments``) if that leaves
        ``at_least`` tokens."""
        ready = tail[0].shape[1] - config.attention.window_tokens
        if whole_segments:
            ready -= ready % config.index.segment_tokens
        return cls(*sinks, *tail, ready if ready >= at_least else 0,
                   sinks[0].shape[1] + num_indexed)

    def ready_tokens(self) -> Pair:
        """``[Hkv, ready, D]`` keys and values to index (views of the tail)."""
        return self.pending_keys[:, :self.ready], self.pending_values[:, :self.ready]
