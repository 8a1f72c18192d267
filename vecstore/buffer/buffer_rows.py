"""The device work of one decode step over a range of a wave buffer's rows.

The wave executor serves an offloaded step in row groups: the first group's misses cross
PCIe while the next group's logits and selection run. :meth:`WaveBuffer.part
<vecstore.buffer.wave_buffer.WaveBuffer.part>` hands out a :class:`BufferRows` per range,
whose tensors are views of the buffer's rows (every table is per row, so groups never touch
each other's entries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vecstore.buffer.wave_buffer import WaveBuffer
    from vecstore.executor.wave_state import Zones

__all__ = ["BufferRows"]


class BufferRows:
    """Rows ``start:stop`` of ``buffer``: lookup, copies and admission of a step.

    The misses of every range are copied on the buffer's one copy stream, in the order the
    ranges are served.
    """

    def __init__(self, buffer: WaveBuffer, start: int, stop: int) -> None:
        rows = slice(start, stop)
        self.keys, self.values = buffer.keys[rows], buffer.values[rows]
        self.cache_k, self.cache_v = buffer.cache_k[rows], buffer.cache_v[rows]
        self.exec_k, self.exec_v = buffer.exec_k[rows], buffer.exec_v[rows]
        self.slot_of, self.owner = buffer.slot_of[rows], buffer.owner[rows]
        self.victims, self.consumed = buffer.victims[rows], buffer.consumed[rows]
        self.slot, self.admitted = buffer.slot[rows], buffer.admitted[rows]
        self.evicted = buffer.evicted[rows]
        self.layout = buffer.layout.rows(start, stop)
        self.counts = buffer.counts
        self.slot_tokens = buffer.slot_tokens
        self.device = buffer.device
        self.copy_stream = buffer.copy_stream
        self._misses_done: torch.cuda.Event | None = None
        self._zones: Zones | None = None

    def lookup(self, zones: Zones) -> None:
        """Find each retrieved cluster's slot (-1 = miss), place it in the execution buffer
        (hits first) and count hits and misses. ``zones`` are this range's rows."""
        from vecstore.executor.wave_cache import lookup_slots

        self._zones = zones
        lookup_slots(zones, self.slot_of, self.slot, self.layout, self.counts)

    def fill_hits(self) -> None:
        """Copy hits from their slots into the execution buffer (current stream)."""
        from vecstore.executor.wave_cache import copy_clusters

        copy_clusters(1, self.layout, self.slot, None, self.cache_k, self.cache_v,
                      self.exec_k, self.exec_v, self.slot_tokens)

    def fill_misses(self) -> None:
        """Copy misses from host memory into the execution buffer, on the copy stream."""
        if self.copy_stream is None:
            self._copy_misses()
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self._copy_misses()
            self._misses_done = torch.cuda.Event()
            self._misses_done.record(self.copy_stream)

    def wait_misses(self) -> None:
        """Make the current stream wait for the step's :meth:`fill_misses` (any number of
        streams may wait)."""
        if self._misses_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._misses_done)

    def plan_admission(self) -> None:
        """Give misses the next usable victim slots (device bookkeeping only).

        A slot is usable if the current victim list has not handed it out already and no
        cluster of this step is in it. It reads no KV, so it runs while
        :meth:`fill_misses` is still copying; :meth:`admit` then moves the rows. The slot
        table says the clusters are cached from here on: :meth:`admit` must run before the
        next :meth:`lookup`.
        """
        from vecstore.executor.wave_cache import plan_admission

        assert self._zones is not None
        plan_admission(self._zones, self.slot, self.victims, self.consumed, self.owner,
                       self.slot_of, self.admitted, self.evicted, self.slot_tokens)

    def admit(self) -> None:
        """Copy the misses :meth:`plan_admission` gave a slot from the execution buffer into
        the cache: after the misses have arrived (:meth:`wait_misses`) and before the next
        :meth:`lookup`."""
        from vecstore.executor.wave_cache import copy_clusters

        copy_clusters(2, self.layout, self.admitted, None, self.exec_k, self.exec_v,
                      self.cache_k, self.cache_v, self.slot_tokens)

    def _copy_misses(self) -> None:
        from vecstore.executor.wave_cache import copy_clusters

        assert self._zones is not None
        copy_clusters(0, self.layout, self.slot, self._zones.first_row, self.keys,
                      self.values, self.exec_k, self.exec_v, self.slot_tokens)
