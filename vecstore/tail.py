"""One buffer for the steady zones of a batch's rows: each row's sinks, then its pending
tail, at fixed capacity, so a decode step appends with two copies for the whole batch and
the batch's steady zone is the buffer itself (no concatenation, fixed shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vecstore.layer import LayerState

__all__ = ["TailBuffer", "append_tails", "writing"]


def writing(t: torch.Tensor) -> torch.inference_mode:
    """A context in which ``t`` may be updated in place whether or not the caller is in
    inference mode: tensors made under ``torch.inference_mode`` (a prefill there) may only
    be written there, others anywhere."""
    return torch.inference_mode(t.is_inference())


@dataclass(eq=False, slots=True)
class TailBuffer:
    """``[B, Hkv, sinks + capacity, D]`` keys and values: row ``b`` holds its layer's
    ``sinks`` sink tokens, then its pending tail, the view ``keys[b, :, sinks:sinks + n]``
    (and ``values[...]``) of that layer. Columns past a row's tokens are unused."""

    keys: torch.Tensor
    values: torch.Tensor
    sinks: int
    _lengths: torch.Tensor | None = None
    _filled: int = -1  # what ``_lengths`` holds

    def lengths(self, n: int) -> torch.Tensor:
        """``[B]`` int64 on the buffer's device: ``sinks + n`` for every row. The same tensor
        each time (filled again only when ``n`` changes), so a captured step may read it in
        place."""
        if self._lengths is None:
            self._lengths = torch.empty(self.keys.shape[0], dtype=torch.long,
                                        device=self.keys.device)
        if self._filled != n:
            with writing(self._lengths):
                self._lengths.fill_(self.sinks + n)
            self._filled = n
        return self._lengths

    @property
    def capacity(self) -> int:
        """Tail tokens a row can hold."""
        return self.keys.shape[2] - self.sinks

    def holds(self, states: list[LayerState], n: int) -> bool:
        """Whether every ``states[b]``'s tail is exactly row ``b``'s first ``n`` tail tokens
        (and its sinks the buffer's)."""
        k0, v0 = self.keys.data_ptr(), self.values.data_ptr()
        size = self.keys.element_size()
        step = self.keys.stride(0) * size
        first = self.sinks * self.keys.stride(2) * size
        return len(states) == self.keys.shape[0] and all(
            st.tail_buffer is self
            and st.pending_keys.data_ptr() == k0 + b * step + first
            and st.pending_values.data_ptr() == v0 + b * step + first
            and st.pending_keys.shape[1] == n and st.pending_values.shape[1] == n
            and st.sink_keys.shape[1] == self.sinks
            for b, st in enumerate(states))

    @staticmethod
    def gather(states: list[LayerState], capacity: int) -> TailBuffer:
        """A new buffer of ``capacity`` tail tokens holding ``states``' sinks and tails
        (equally many of each), which it becomes the tail of."""
        first = states[0]
        n, sinks = first.pending_keys.shape[1], first.sink_keys.shape[1]
        H, D = first.num_kv_heads, first.head_dim
        shape = (len(states), H, sinks + capacity, D)
        buf = TailBuffer(first.sink_keys.new_zeros(shape), first.sink_values.new_zeros(shape),
                         sinks)
        for dst, name in ((buf.keys, "keys"), (buf.values, "values")):
            dst[:, :, :sinks].copy_(torch.stack([getattr(st, f"sink_{name}") for st in states]))
            if n:
                dst[:, :, sinks:sinks + n].copy_(
                    torch.stack([getattr(st, f"pending_{name}") for st in states]))
        for st in states:
            st.tail_buffer = buf
        buf.extend(states, n)
        return buf

    def extend(self, states: list[LayerState], n: int) -> None:
        """Make every ``states[b]``'s tail the buffer's first ``n`` tail tokens of row ``b``
        (tokens already written there, e.g. by a captured decode step)."""
        end = self.sinks + n
        for b, st in enumerate(states):
            st.pending_keys = self.keys[b, :, self.sinks:end]
            st.pending_values = self.values[b, :, self.sinks:end]


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
    H, D = keys.shape[1], keys.shape[3]
    buf = first.tail_buffer
    if (buf is None or buf.keys.shape[1] != H or buf.capacity < n + T
            or buf.keys.shape[3] != D or buf.keys.dtype != keys.dtype
            or buf.keys.device != keys.device or not buf.holds(states, n)):
        buf = TailBuffer.gather(states, max(window + update, n + T))
    with writing(buf.keys):
        buf.keys[:, :, sinks + n:sinks + n + T].copy_(keys)
        buf.values[:, :, sinks + n:sinks + n + T].copy_(values)
    buf.extend(states, n + T)
    return True
