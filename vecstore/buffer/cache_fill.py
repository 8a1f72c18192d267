"""Filling a wave buffer's block cache before its first step.

A new :class:`~vecstore.buffer.wave_buffer.WaveBuffer` would otherwise start empty and read
every retrieved cluster over PCIe until its steps had admitted them. Two fills, both device
work between steps and one bookkeeping record (the policy sees the clusters placed as
admitted):

- :func:`take_over`: after a segment flush, the buffer of the grown view holds what the old
  view's buffer held, in the same slots (a device copy);
- :func:`warm`: the slots still free take the newest clusters, read zero-copy from the KV
  rows in one launch.

Rows are ``b * Hkv + h``.
"""

from __future__ import annotations

import torch

from vecstore.buffer.bookkeeping import StepRecord
from vecstore.buffer.wave_buffer import WaveBuffer
from vecstore.errors import InvalidValueError
from vecstore.kernels.exec_layout import ExecLayout

__all__ = ["can_take_over", "take_over", "warm"]


def can_take_over(new: WaveBuffer, old: WaveBuffer) -> bool:
    """Whether :func:`take_over` accepts ``old`` for ``new``: the same rows, slot size and
    KV layout, and no more clusters or slots than ``new``'s."""
    return ((old.rows, old.slot_tokens, old.cache_k.shape[2], old.cache_k.dtype,
             old.device) == (new.rows, new.slot_tokens, new.cache_k.shape[2],
                             new.cache_k.dtype, new.device)
            and old.num_slots <= new.num_slots and old.num_clusters <= new.num_clusters)


def take_over(new: WaveBuffer, old: WaveBuffer) -> None:
    """Make ``new`` hold what ``old`` holds: the buffer of a view ``new``'s extends (the
    same rows, clusters appended), so a segment flush keeps the cache instead of starting
    anew.

    ``old``'s cached clusters keep their slots (its slots are ``new``'s first ones; their
    rows are copied on the device, nothing crosses PCIe), the slots added come first in the
    victim list, then ``old``'s in its order, and the policy sees the kept clusters
    admitted in that order. The hit and miss counters carry on from ``old``'s. Call it on a
    new buffer before :func:`warm` and its first step; ``old`` is left as it was (close it
    after).

    Raises
    ------
    InvalidValueError
        ``old`` has other rows, slot sizes or KV layout, or more clusters or slots.
    """
    S0, C0, T = old.num_slots, old.num_clusters, new.slot_tokens
    if not can_take_over(new, old):
        raise InvalidValueError(
            f"take_over: a buffer of {old.rows} rows, {C0} clusters and {S0} slots of "
            f"{old.slot_tokens} cannot pass its cache to one of {new.rows} rows, "
            f"{new.num_clusters} clusters and {new.num_slots} slots of {T}")
    new.cache_k[:, :S0 * T].copy_(old.cache_k)
    new.cache_v[:, :S0 * T].copy_(old.cache_v)
    new.slot_of[:, :C0].copy_(old.slot_of[:, :C0])
    new.owner[:, :S0].copy_(old.owner[:, :S0])
    added = torch.arange(S0, new.num_slots, dtype=torch.int32, device=new.device)
    new.victims.copy_(torch.cat([added.expand(new.rows, -1), old.victims], dim=1))
    new.consumed.zero_()
    new.counts.copy_(old.counts)
    # the policy: the kept clusters admitted in the old list's order (evicted first first)
    held = old.owner.gather(1, old.victims.long())
    order = torch.where(held >= 0, 0, 1).argsort(dim=1, stable=True)
    count = (held >= 0).sum(1)
    valid = torch.arange(S0, device=new.device)[None, :] < count[:, None]
    _admitted(new, held.gather(1, order), old.victims.gather(1, order), valid)


def warm(buf: WaveBuffer, sizes: torch.Tensor, first_row: torch.Tensor) -> int:
    """Fill each row's free slots of ``buf`` with the newest clusters not cached yet, before
    a step needs them, and return how many clusters were placed over all rows.

    The newest clusters (highest ids: the latest segment's) go first, as the ones a decode
    step is likeliest to retrieve; clusters larger than a slot are never cached. Rows are
    read zero-copy from the KV rows (host memory) in one launch; the policy sees the placed
    clusters as admitted, oldest first, and the victim list evicts free slots first, then
    those held before in their order, then the placed ones oldest first. Hit and miss
    counters are unchanged.

    Parameters
    ----------
    sizes, first_row : torch.Tensor
        ``[rows, C]`` int32 cluster sizes and first KV rows, on the buffer's device.
    """
    from vecstore.kernels.cluster_copy import copy_clusters

    rows, C, S, T = buf.rows, buf.num_clusters, buf.num_slots, buf.slot_tokens
    dev, i32 = buf.device, torch.int32
    free = buf.owner[:, :S] < 0
    cand = (buf.slot_of[:, :C] < 0) & (sizes > 0) & (sizes <= T)
    # newest first: a candidate is taken if fewer than the row's free slots are newer
    newer = cand.flip(1).cumsum(1).flip(1)
    take = cand & (newer <= free.sum(1, keepdim=True))
    width = min(S, C)
    ids = torch.arange(C, device=dev).expand(rows, C)
    chosen = torch.where(take, ids, C + ids).argsort(dim=1)[:, :width]
    slots = torch.arange(S, device=dev).expand(rows, S)
    given = torch.where(free, slots, S + slots).argsort(dim=1)[:, :width]
    count = take.sum(1).to(i32)
    valid = torch.arange(width, device=dev)[None, :] < count[:, None]
    layout = ExecLayout(count, torch.where(valid, sizes.gather(1, chosen), 0).to(i32),
                        (given * T).to(i32), torch.zeros(rows, dtype=i32, device=dev))
    copy_clusters(0, layout, torch.full_like(chosen, -1, dtype=i32),
                  first_row.gather(1, chosen).to(i32), buf.keys, buf.values,
                  buf.cache_k, buf.cache_v, T)
    # the tables; past a row's count the writes go to the dump columns, reset after
    buf.slot_of.scatter_(1, torch.where(valid, chosen, C), torch.where(valid, given, -1).to(i32))
    buf.owner.scatter_(1, torch.where(valid, given, S), torch.where(valid, chosen, -1).to(i32))
    buf.slot_of[:, C] = -1
    buf.owner[:, S] = -1
    # the victim list: free slots first, then those held before in their order, then
    # the placed ones in the order they were given (oldest cluster first)
    placed = torch.zeros(rows, S, dtype=torch.bool, device=dev)
    placed.scatter_(1, given, valid)
    held = torch.empty_like(slots)
    held.scatter_(1, buf.victims.long(), slots)  # each slot's place in the old list
    key = torch.where(placed, 2 * S + slots, torch.where(free, slots, S + held))
    buf.victims.copy_(key.argsort(dim=1))
    buf.consumed.zero_()
    _admitted(buf, chosen, given, valid)
    return int(count.sum())


def _admitted(buf: WaveBuffer, ids: torch.Tensor, slots: torch.Tensor,
              valid: torch.Tensor) -> None:
    """Feed ``buf``'s policy clusters ``ids`` placed in ``slots`` (``[rows, W]``, where
    ``valid``: a prefix of each row) as one step's admissions, in column order."""
    i32 = torch.int32
    none = torch.full(ids.shape, -1, dtype=i32)
    buf.bookkeeper.submit(StepRecord(
        torch.where(valid, ids, -1).to(i32).cpu(), none,
        torch.where(valid, slots, -1).to(i32).cpu(), none, valid.sum(1).to(i32).cpu(),
        ready=None))
