"""A batch's steady zones (sinks and pending tails) as one ``[B, Hkv, S, D]`` pair the
executor reads: the rows' shared tail buffer itself where they have one, else a padded
stack."""

from __future__ import annotations

import torch

from vecstore.engine.layer_state import LayerState
from vecstore.engine.sequence import Sequence
from vecstore.engine.shared_tail import gather, holds
from vecstore.executor.base import Steady

__all__ = ["stack_steady"]


def stack_steady(seqs: list[Sequence], layer: int) -> Steady:
    """The steady zones of ``layer`` of ``seqs``, zero-padded to ``[B, Hkv, S, D]``.

    Never waits for the device: rows whose sinks are full and whose tails are equally long
    share a :class:`~vecstore.engine.tail.TailBuffer` (gathered into one at their first query),
    which is the steady zone as it is (``S`` is its capacity, the lengths say how much is
    filled, ``persistent``); other rows are zero-padded, their lengths copied from (pinned)
    host memory, asynchronously.
    """
    states = [s.layers[layer] for s in seqs]
    tail, at = states[0].tail_buffer, states[0].tail_at
    if tail is not None and at is not None and holds(tail, states, at[2]):
        # the common case of a decode loop, checked before any tail is sliced
        return Steady(tail.keys, tail.values, tail.lengths(at[2]), True)
    dev = states[0].device
    if _same_shapes(states) and len({id(st) for st in states}) == len(states):
        n = states[0].pending_keys.shape[1]
        a = states[0].config.attention
        tail = states[0].tail_buffer
        if tail is None or not holds(tail, states, n):
            # the rows' steady zones move into one buffer (once) if their sinks are full:
            # later queries and decode appends use it in place
            full = states[0].sink_keys.shape[1] == a.sink_tokens
            tail = gather(states, max(a.window_tokens + a.update_tokens, n)) if full else None
        if tail is not None:
            return Steady(tail.keys, tail.values, tail.lengths(n), True)
    parts = [st.steady() for st in states]
    sizes = [k.shape[1] for k, _ in parts]
    S = max(sizes)
    if len(parts) == 1:
        k, v = parts[0]
        return Steady(k[None], v[None], torch.full((1,), S, dtype=torch.long, device=dev))
    if min(sizes) == S:
        return Steady(torch.stack([k for k, _ in parts]), torch.stack([v for _, v in parts]),
                      torch.full((len(parts),), S, dtype=torch.long, device=dev))

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(x.shape[0], S - x.shape[1], x.shape[2])], dim=1)

    lengths = torch.tensor(sizes)
    if dev.type == "cuda":
        lengths = lengths.pin_memory().to(dev, non_blocking=True)
    else:
        lengths = lengths.to(dev)
    return Steady(torch.stack([pad(k) for k, _ in parts]),
                  torch.stack([pad(v) for _, v in parts]), lengths)


def _same_shapes(states: list[LayerState]) -> bool:
    """Whether every layer holds as many sinks, and as many tail tokens, as the first."""
    sink, tail = states[0].sink_keys.shape[1], states[0].pending_keys.shape[1]
    return all(st.sink_keys.shape[1] == sink and st.pending_keys.shape[1] == tail
               for st in states)
