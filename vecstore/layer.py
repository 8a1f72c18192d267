"""One layer of one sequence: the steady zone, the indexed segments, and their growth."""

from __future__ import annotations

import torch

from vecstore.config import StoreConfig
from vecstore.index.base import Index, IndexView, Segment

__all__ = ["LayerState"]


class LayerState:
    """Tokens of one layer: sinks, indexed segments, and a pending tail.

    Tokens ``[0, sink)`` stay in ``sink_keys``; later tokens enter the pending tail,
    and whenever the tail exceeds ``window_tokens + update_tokens`` all but its last
    ``window_tokens`` are indexed into new segments. Sinks and the tail form the exact
    steady zone.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, index: Index, config: StoreConfig) -> None:
        empty = torch.empty(num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.sink_keys, self.sink_values = empty, empty
        self.pending_keys, self.pending_values = empty, empty
        self.segments: list[Segment] = []
        self.device = torch.device(device)
        self.index = index
        self.config = config
        self.version = 0  # bumped whenever segments change
        self._view: IndexView | None = None

    @property
    def num_tokens(self) -> int:
        return (self.sink_keys.shape[1] + self.pending_keys.shape[1]
                + sum(s.num_tokens for s in self.segments))

    @property
    def num_indexed(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> list[Segment]:
        """Add ``[Hkv, T, D]`` tokens; returns the segments this append created."""
        a = self.config.attention
        room = a.sink_tokens - self.sink_keys.shape[1]
        if room > 0:
            self.sink_keys = torch.cat([self.sink_keys, keys[:, :room]], dim=1)
            self.sink_values = torch.cat([self.sink_values, values[:, :room]], dim=1)
            keys, values = keys[:, room:], values[:, room:]
        self.pending_keys = torch.cat([self.pending_keys, keys], dim=1)
        self.pending_values = torch.cat([self.pending_values, values], dim=1)
        ready = self.pending_keys.shape[1] - a.window_tokens
        if ready < a.update_tokens:
            return []
        start = self.sink_keys.shape[1] + self.num_indexed
        new = self.index.build(self.pending_keys[:, :ready], self.pending_values[:, :ready], start)
        self.pending_keys = self.pending_keys[:, ready:].contiguous()
        self.pending_values = self.pending_values[:, ready:].contiguous()
        self.add_segments(new)
        return new

    def add_segments(self, segments: list[Segment]) -> None:
        """Attach already-built segments (appends and reopened stores)."""
        self.segments.extend(segments)
        self.version += 1
        self._view = None

    def to(self, device: torch.device) -> None:
        """Move every tensor of the layer to ``device`` (loading it first if lazy)."""
        device = torch.device(device)
        if device == self.device:
            return
        self.sink_keys, self.sink_values = self.sink_keys.to(device), self.sink_values.to(device)
        self.pending_keys = self.pending_keys.to(device)
        self.pending_values = self.pending_values.to(device)
        self.segments = [
            Segment(s.start, s.end, s.keys.to(device), s.values.to(device),
                    s.offsets.to(device), {k: v.to(device) for k, v in s.meta.items()})
            for s in self.segments
        ]
        self.device = device
        self.version += 1
        self._view = None

    def steady(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[Hkv, S, D]`` keys and values of the steady zone (sinks, then the tail)."""
        return (torch.cat([self.sink_keys, self.pending_keys], dim=1),
                torch.cat([self.sink_values, self.pending_values], dim=1))

    def view(self) -> IndexView | None:
        """The indexed segments as a ``B = 1`` view, cached until they change."""
        if not self.segments:
            return None
        if self._view is None:
            self._view = IndexView.from_segments(self.segments)
        return self._view
