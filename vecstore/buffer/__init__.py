"""The wave buffer: per-layer GPU block cache, execution buffer, and policy bookkeeping."""

from vecstore.buffer.bookkeeping import PolicyBookkeeper as PolicyBookkeeper
from vecstore.buffer.bookkeeping import StepRecord as StepRecord
from vecstore.buffer.wave_buffer import BufferStats as BufferStats
from vecstore.buffer.wave_buffer import WaveBuffer as WaveBuffer

__all__ = ["WaveBuffer", "BufferStats", "PolicyBookkeeper", "StepRecord"]
