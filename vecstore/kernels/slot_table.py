"""Triton kernels of the wave buffer's slot table (:class:`vecstore.buffer.WaveBuffer`): the
slot lookup of the retrieved clusters, and the choice of slots for the misses.

Rows are ``b * Hkv + h``; retrieved cluster ``i`` (of ``count``) of a row holds
``cum[i + 1] - cum[i]`` rows (:class:`vecstore.kernels.zones.Zones`). The execution
buffer holds a row's hits first, then its misses, each in retrieved order, so the attention
over the hits runs while the misses cross PCIe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels.backend import LazyKernel
from vecstore.kernels.exec_layout import ExecLayout
from vecstore.kernels.radix_select import chained, follow
from vecstore.kernels.slot_scratch import AdmissionScratch
from vecstore.kernels.zones import Zones

__all__ = ["lookup_slots", "plan_admission"]

_LOOKUP_BLOCK = 2048  # retrieved clusters per step of the lookup's loop over a row
_LOOKUP_WARPS = 8


def _lookup_kernel(ids_ptr, cum_ptr, count_ptr, slot_of_ptr, slot_ptr, l_count_ptr, size_ptr,
                   pos_ptr, split_ptr, counts_ptr, C, R_MAX, BLOCK: tl.constexpr,
                   GDC: tl.constexpr):
    # one row's retrieved clusters, BLOCK at a time: cache slot (-1: a miss, or past count),
    # size, place among the row's hits (hits) or among its misses (misses), in retrieved
    # order; the row's count and hit rows (split), and its hits, misses, hit rows and miss
    # rows added to counts [4] (int64)
    follow(GDC)
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(count_ptr + row)
    tl.store(l_count_ptr + row, count)
    hit_rows = 0
    n_hit = 0
    miss_rows = 0
    for i0 in range(0, R_MAX, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        valid = i < count
        cid = tl.load(ids_ptr + row * R_MAX + i, mask=valid, other=0)
        slot = tl.load(slot_of_ptr + row * (C + 1) + cid, mask=valid, other=-1)
        tl.store(slot_ptr + row * R_MAX + i, slot, mask=i < R_MAX)
        start = tl.load(cum_ptr + row * (R_MAX + 1) + i, mask=valid, other=0)
        size = tl.load(cum_ptr + row * (R_MAX + 1) + i + 1, mask=valid, other=0) - start
        hit = valid & (slot >= 0)
        h = tl.where(hit, size, 0)
        before = hit_rows + tl.cumsum(h, axis=0) - h  # hit rows before cluster i
        # miss rows before cluster i: the rows before it that are not hit rows
        tl.store(pos_ptr + row * R_MAX + i, tl.where(hit, before, start - before), mask=valid)
        tl.store(size_ptr + row * R_MAX + i, size, mask=valid)
        hit_rows += tl.sum(h, axis=0)
        n_hit += tl.sum(hit.to(tl.int32), axis=0)
        miss_rows += tl.sum(tl.where(valid & (slot < 0), size, 0), axis=0)
    tl.store(split_ptr + row, hit_rows)
    tl.atomic_add(counts_ptr + 0, n_hit.to(tl.int64))
    tl.atomic_add(counts_ptr + 1, (count - n_hit).to(tl.int64))
    tl.atomic_add(counts_ptr + 2, hit_rows.to(tl.int64))
    tl.atomic_add(counts_ptr + 3, miss_rows.to(tl.int64))


def _admission_kernel(slot_ptr, cum_ptr, count_ptr, ids_ptr, victims_ptr, consumed_ptr,
                      owner_ptr, slot_of_ptr, mark_ptr, free_ptr, admitted_ptr, evicted_ptr,
                      C, S, R_MAX, SLOT_T, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    # one row: misses that fit a slot take the next usable slots of the victim list (usable:
    # not handed out since the list arrived, and held by no hit of the step), in retrieved
    # order; the slot tables follow. The victim list is read only as far as the misses need
    # (nowhere at a step of hits only), and mark[slot] (held by a hit of the step) is cleared
    # where it was set, so a row's cost follows its retrieved clusters, not its slots: a
    # cache of every cluster has as many slots as the row has clusters. Phases meet through
    # memory, so a barrier between them
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(count_ptr + row)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    n_need = 0
    for i0 in range(0, R_MAX, BLOCK_R):
        i = i0 + offs_r
        valid = i < count
        s = tl.load(slot_ptr + row * R_MAX + i, mask=valid, other=-1)
        tl.store(mark_ptr + row * S + s, 1, mask=valid & (s >= 0))
        size = (tl.load(cum_ptr + row * (R_MAX + 1) + i + 1, mask=valid, other=0)
                - tl.load(cum_ptr + row * (R_MAX + 1) + i, mask=valid, other=0))
        n_need += tl.sum((valid & (s < 0) & (size <= SLOT_T)).to(tl.int32), axis=0)
    tl.debug_barrier()
    n_usable = n_need * 0
    scanned = n_need * 0
    while (scanned < S) & (n_usable < n_need):  # the usable slots in victim order
        j = scanned + offs_s
        usable, v = _usable(victims_ptr, consumed_ptr, mark_ptr, row, S, j)
        u = usable.to(tl.int32)
        tl.store(free_ptr + row * S + n_usable + tl.cumsum(u, axis=0) - u, v, mask=usable)
        n_usable += tl.sum(u, axis=0)
        scanned += BLOCK_S
    tl.debug_barrier()
    n_miss = 0
    for i0 in range(0, R_MAX, BLOCK_R):
        i = i0 + offs_r
        inside = i < R_MAX
        valid = i < count
        s = tl.load(slot_ptr + row * R_MAX + i, mask=valid, other=0)
        size = (tl.load(cum_ptr + row * (R_MAX + 1) + i + 1, mask=valid, other=0)
                - tl.load(cum_ptr + row * (R_MAX + 1) + i, mask=valid, other=0))
        miss = valid & (s < 0) & (size <= SLOT_T)
        m = miss.to(tl.int32)
        rank = n_miss + tl.cumsum(m, axis=0) - m
        ok = miss & (rank < n_usable)
        adm = tl.load(free_ptr + row * S + rank, mask=ok, other=-1)
        old = tl.load(owner_ptr + row * (S + 1) + adm, mask=ok, other=-1)
        cid = tl.load(ids_ptr + row * R_MAX + i, mask=ok, other=0)
        # the evicted clusters are cached, the admitted ones are not: no entry is written twice
        tl.store(slot_of_ptr + row * (C + 1) + old, -1, mask=ok & (old >= 0))
        tl.store(owner_ptr + row * (S + 1) + adm, cid, mask=ok)
        tl.store(slot_of_ptr + row * (C + 1) + cid, adm, mask=ok)
        tl.store(admitted_ptr + row * R_MAX + i, adm, mask=inside)
        tl.store(evicted_ptr + row * R_MAX + i, old, mask=inside)
        n_miss += tl.sum(m, axis=0)
    n_taken = tl.minimum(n_miss, n_usable)
    n_usable = n_taken * 0
    for j0 in range(0, scanned, BLOCK_S):  # the slots handed out are consumed until a new list
        j = j0 + offs_s
        usable, _ = _usable(victims_ptr, consumed_ptr, mark_ptr, row, S, j)
        u = usable.to(tl.int32)
        taken = usable & (n_usable + tl.cumsum(u, axis=0) - u < n_taken)
        tl.store(consumed_ptr + row * S + j, 1, mask=taken)
        n_usable += tl.sum(u, axis=0)
    tl.debug_barrier()
    for i0 in range(0, R_MAX, BLOCK_R):  # the marks go as they came: the scratch stays zeroed
        i = i0 + offs_r
        valid = i < count
        s = tl.load(slot_ptr + row * R_MAX + i, mask=valid, other=-1)
        tl.store(mark_ptr + row * S + s, 0, mask=valid & (s >= 0))


@triton.jit
def _usable(victims_ptr, consumed_ptr, mark_ptr, row, S, j):
    # victim positions j of a row: whether each is usable, and its slot
    inside = j < S
    v = tl.load(victims_ptr + row * S + j, mask=inside, other=0)
    consumed = tl.load(consumed_ptr + row * S + j, mask=inside, other=1).to(tl.int32)
    held = tl.load(mark_ptr + row * S + v, mask=inside, other=1).to(tl.int32)
    return inside & (consumed == 0) & (held == 0), v


_LOOKUP = LazyKernel(_lookup_kernel)
_ADMISSION = LazyKernel(_admission_kernel)


def lookup_slots(zones: Zones, slot_of: torch.Tensor, slot: torch.Tensor, layout: ExecLayout,
                 counts: torch.Tensor) -> None:
    """Each retrieved cluster's cache slot ``slot [rows, R]`` int32 from the slot table
    ``slot_of [rows, C + 1]`` (-1: not cached; also past a row's ``count``), and the step's
    ``layout`` of the execution buffer; adds the step's hits, misses, hit rows and miss rows
    to ``counts [4]`` int64. One program per row, where the torch version took about 20
    small ops (80 us of the offloaded step at 1 x 1M on the H200, before the miss copy could
    start); chained after the selection's zone write on its stream (programmatic dependent
    launch where the device has it)."""
    rows, r_max = zones.ids.shape
    _LOOKUP[(rows,)](
        zones.ids, zones.cum, zones.count, slot_of, slot, layout.count, layout.size, layout.pos,
        layout.split, counts, slot_of.shape[1] - 1, r_max,
        BLOCK=min(_LOOKUP_BLOCK, max(16, triton.next_power_of_2(r_max))),
        num_warps=_LOOKUP_WARPS, **chained(slot.device))


def plan_admission(zones: Zones, slot: torch.Tensor, victims: torch.Tensor,
                   consumed: torch.Tensor, owner: torch.Tensor, slot_of: torch.Tensor,
                   admitted: torch.Tensor, evicted: torch.Tensor, slot_tokens: int,
                   scratch: AdmissionScratch | None = None) -> None:
    """Give the step's misses (``slot < 0``, at most ``slot_tokens`` rows) the next usable
    slots of the victim list ``victims [rows, S]`` and update the slot tables.

    A victim position is usable if ``consumed [rows, S]`` (bool) does not mark it and no hit
    of the step holds its slot; misses take them in retrieved order while they last. Writes
    ``admitted``/``evicted [rows, R]`` (the slot given and the cluster it held, -1 for none),
    ``owner [rows, S + 1]``, ``slot_of [rows, C + 1]`` and marks the positions handed out in
    ``consumed``. One program per row: a launch, where the torch version took about 20 small
    ops. ``scratch``: the launch's working memory, kept by the caller across steps (it
    stays zeroed); by default allocated for the call.
    """
    rows, r_max = zones.ids.shape
    num_slots = victims.shape[1]
    if scratch is None:
        scratch = AdmissionScratch.empty(rows, num_slots, slot.device)
    _ADMISSION[(rows,)](
        slot, zones.cum, zones.count, zones.ids, victims, consumed, owner, slot_of,
        scratch.mark, scratch.free, admitted, evicted, slot_of.shape[1] - 1, num_slots, r_max,
        slot_tokens,
        BLOCK_S=min(1024, max(16, triton.next_power_of_2(num_slots))),
        BLOCK_R=min(1024, max(16, triton.next_power_of_2(r_max))))
