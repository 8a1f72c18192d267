"""One buffer for the pending tails of a batch's rows, so a decode step appends with two
copies for the whole batch instead of two concatenations per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vecstore.layer import LayerState

__all__ = ["TailBuffer", "append_tails"]


@dataclass(eq=False, slots=True)
class TailBuffer:
    """``[B, Hkv, capacity, D]`` keys and values; row ``b``'s pending tail is the view
    ``keys[b, :, :n]`` (and ``values[b, :, :n]``) of its layer."""

    keys: torch.Tensor
    values: torch.Tensor

    def holds(self, states: list[LayerState], n: int) -> bool:
        """Whether every ``states[b]``'s tail is exactly row ``b``'s first ``n`` tokens."""
        k0, v0 = self.keys.data_ptr(), self.values.data_ptr()
        step = self.keys.stride(0) * self.keys.element_size()
        return len(states) == self.keys.shape[0] and all(
            st.pending_keys.data_ptr() == k0 + b * step
            and st.pending_values.data_ptr() == v0 + b * step
            and st.pending_keys.shape[1] == n and st.pending_values.shape[1] == n
            for b, st in enumerate(states))


def append_tails(states: list[LayerState], keys: torch.Tensor, values: torch.Tensor,
                 window: int, update: int, sinks: int) -> bool:
    """Append ``keys[b], values[b]`` (``[B, Hkv, T, D]``, contiguous) to the pending tail of
    ``states[b]`` through one shared :class:`TailBuffer`; returns ``False``, changing
    nothing, when the batch does not qualify (the caller appends row by row then).

    It qualifies when the rows are distinct layers whose sinks are full, whose tails are
    equally long, and none of which indexes its tail with these tokens (``window`` and
    ``update`` of the attention config). The rows keep the buffer's first tokens as views
    and it only ever writes past every row's length, so earlier views (a transaction's
    mark, a tail being persisted) never see a write; a rollback's shorter tails are
    simply overwritten by the next append.
    """
    T = keys.shape[2]
    first = states[0]
    n = first.pending_keys.shape[1]
    if (len({id(st) for st in states}) != len(states) or n + T - window >= update
            or any(st.sink_keys.shape[1] != sinks or st.pending_keys.shape[1] != n
                   for st in states)):
        return False
    B, H, _, D = keys.shape
    buf = first.tail_buffer
    if (buf is None or buf.keys.shape[1] != H or buf.keys.shape[2] < n + T
            or buf.keys.shape[3] != D or buf.keys.dtype != keys.dtype
            or buf.keys.device != keys.device
            or any(st.tail_buffer is not buf for st in states) or not buf.holds(states, n)):
        capacity = max(window + update, n + T)
        buf = TailBuffer(keys.new_empty(B, H, capacity, D), values.new_empty(B, H, capacity, D))
        if n:
            buf.keys[:, :, :n].copy_(torch.stack([st.pending_keys for st in states]))
            buf.values[:, :, :n].copy_(torch.stack([st.pending_values for st in states]))
    buf.keys[:, :, n:n + T].copy_(keys)
    buf.values[:, :, n:n + T].copy_(values)
    for b, st in enumerate(states):
        st.pending_keys, st.pending_values = buf.keys[b, :, :n + T], buf.values[b, :, :n + T]
        st.tail_buffer = buf
    return True
