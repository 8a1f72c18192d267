"""The layers of a batch's rows sharing one :class:`~vecstore.engine.tail.TailBuffer`: gathering
their steady zones into it, checking that they still read from it, and appending a decode
step's tokens to all of them with two copies."""

from __future__ import annotations

import torch

from vecstore.engine.layer_state import LayerState
from vecstore.engine.tail import TailBuffer, writing

__all__ = ["append_tails", "extend", "gather", "holds"]


def holds(buf: TailBuffer, states: list[LayerState], n: int) -> bool:
    """Whether every ``states[b]``'s tail is exactly row ``b``'s first ``n`` tail tokens of
    ``buf`` (and its sinks the buffer's)."""
    return len(states) == buf.keys.shape[0] and all(
        st.tail_buffer is buf and st.sink_keys.shape[1] == buf.sinks
        and (st.tail_at == (buf, b, n) or (
            st.pending_keys.shape[1] == n and st.pending_values.shape[1] == n
            and buf.holds_row(b, st.pending_keys, st.pending_values)))
        for b, st in enumerate(states))


def gather(states: list[LayerState], capacity: int) -> TailBuffer:
    """A new buffer of ``capacity`` tail tokens holding ``states``' sinks and tails
    (equally many of each), which it becomes the tail of."""
    first = states[0]
    n, sinks = first.pending_keys.shape[1], first.sink_keys.shape[1]
    H, D = first.num_kv_heads, first.head_dim
    shape = (len(states), H, sinks + capacity, D)
    buf = TailBuffer(first.sink_keys.new_zeros(shape), first.sink_values.new_zeros(shape),
                     sinks)
    buf.keys[:, :, :sinks].copy_(torch.stack([st.sink_keys for st in states]))
    buf.values[:, :, :sinks].copy_(torch.stack([st.sink_values for st in states]))
    if n:
        buf.keys[:, :, sinks:sinks + n].copy_(torch.stack([st.pending_keys for st in states]))
        buf.values[:, :, sinks:sinks + n].copy_(
            torch.stack([st.pending_values for st in states]))
    extend(buf, states, n)
    return buf


def extend(buf: TailBuffer, states: list[LayerState], n: int) -> None:
    """Make every ``states[b]``'s tail the first ``n`` tail tokens of row ``b`` of ``buf``
    (tokens already written there, e.g. by a captured decode step)."""
    for b, st in enumerate(states):
        st.read_tail_from(buf, b, n)


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
            or buf.keys.device != keys.device or not holds(buf, states, n)):
        buf = gather(states, max(window + update, n + T))
    with writing(buf.keys):
        buf.keys[:, :, sinks + n:sinks + n + T].copy_(keys)
        buf.values[:, :, sinks + n:sinks + n + T].copy_(values)
    extend(buf, states, n + T)
    return True
