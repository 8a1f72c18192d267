"""The wave buffer: a per-layer GPU block cache in front of offloaded KV, and the execution buffer.

Per step, after the retrieved clusters are chosen
(:class:`~vecstore.executor.wave_state.Zones`), for all rows or row group by row group
(:meth:`WaveBuffer.part`, a :class:`~vecstore.buffer.buffer_rows.BufferRows`):

1. :meth:`BufferRows.lookup` reads each retrieved cluster's slot from the GPU slot table
   (hits and misses per (sequence, KV head) row, no host round trip) and lays out the
   execution buffer: a row's hits first (rows ``0:split``), then its misses
   (``split:total``).
2. :meth:`BufferRows.fill_hits` copies hits from their cache slots, and
   :meth:`BufferRows.fill_misses` copies misses from the KV rows in pinned host memory on a
   side CUDA stream, so that the execution buffer holds every retrieved row contiguously.
   The executor attends the hits while the misses are copied.
3. :meth:`BufferRows.plan_admission` gives misses the next usable slots of the victim list,
   and :meth:`BufferRows.admit` copies them into the cache from the execution buffer once
   they have arrived: no cluster crosses PCIe twice. Clusters larger than a slot are never
   cached.
4. :meth:`WaveBuffer.finish_step` hands the step's record to the
   :class:`~vecstore.buffer.bookkeeping.PolicyBookkeeper` (policy on a CPU thread), and
   :meth:`WaveBuffer.begin_step` installs the newest victim list it published.

Steps 1-3 are plain device work of fixed shapes (CUDA-graph capturable); 4 runs between
steps. Rows are ``b * Hkv + h``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vecstore.buffer.bookkeeping import PolicyBookkeeper, StepRecord
from vecstore.buffer.budget import account_for
from vecstore.buffer.buffer_rows import BufferRows
from vecstore.buffer.layout import ExecLayout
from vecstore.kvstore.base import MemoryAccount

__all__ = ["WaveBuffer", "BufferStats"]


@dataclass(frozen=True, slots=True)
class BufferStats:
    """Cache counters over all steps since the buffer was built.

    Attributes
    ----------
    hits, misses : int
        Retrieved clusters found in the cache, and read from host memory.
    hit_rows, miss_rows : int
        KV rows (tokens, per KV head) behind them.
    """

    hits: int
    misses: int
    hit_rows: int
    miss_rows: int

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class WaveBuffer:
    """GPU block cache and execution buffer of one layer over ``rows`` (sequence, head) rows.

    Parameters
    ----------
    keys, values : torch.Tensor
        ``[rows, N, D]`` cluster-contiguous KV rows in host memory (pinned where CUDA is).
    num_clusters : int
        Clusters per row, ``C``.
    r_max : int
        Most clusters retrieved per row and step.
    exec_rows : int
        Rows of the execution buffer per row: at least the sizes of the ``r_max`` largest
        clusters, so a step always fits.
    num_slots : int
        Cache slots per row.
    slot_tokens : int
        Rows per slot; larger clusters bypass the cache.
    device : torch.device
        The GPU (or ``cpu`` for simulated tiers in tests).
    policy : str
        Replacement policy name (:data:`vecstore.cache.POLICIES`).
    account : MemoryAccount, optional
        GPU budget charged for the cache and buffers; checked before allocating. Without
        one, the account of the enclosing :func:`vecstore.buffer.budget.charging` block
        (the store's ``kvstore.gpu_budget_gb`` for ``device``), if any.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, *, num_clusters: int,
                 r_max: int, exec_rows: int, num_slots: int, slot_tokens: int,
                 device: torch.device, policy: str = "lru",
                 account: MemoryAccount | None = None) -> None:
        rows, _, dim = keys.shape
        self.keys, self.values = keys, values
        self.rows, self.num_clusters, self.num_slots = rows, num_clusters, num_slots
        self.slot_tokens, self.r_max = slot_tokens, r_max
        self.device = device
        row_bytes = 2 * dim * keys.element_size()
        self.num_bytes = rows * (row_bytes * (num_slots * slot_tokens + exec_rows)
                                 + 4 * (num_clusters + 3 + 2 * (num_slots + 1) + 5 * r_max))
        if account is None:
            account = account_for(device)
        if account is not None:  # before allocating: a clear error, not an OOM
            account.charge(self.num_bytes, f"a wave buffer (block cache of {num_slots} slots "
                           f"x {slot_tokens} rows and execution buffer of {exec_rows} rows, "
                           f"for {rows} KV rows)")
        self.account = account
        kw = {"device": device}
        self.cache_k = torch.empty(rows, num_slots * slot_tokens, dim, dtype=keys.dtype, **kw)
        self.cache_v = torch.empty_like(self.cache_k)
        self.exec_k = torch.empty(rows, exec_rows, dim, dtype=keys.dtype, **kw)
        self.exec_v = torch.empty_like(self.exec_k)
        i32 = torch.int32
        self.slot_of = torch.full((rows, num_clusters + 1), -1, dtype=i32, **kw)  # col C: dump
        self.owner = torch.full((rows, num_slots + 1), -1, dtype=i32, **kw)  # col S: dump
        self.victims = torch.arange(num_slots, dtype=i32, **kw).repeat(rows, 1)
        self.consumed = torch.zeros(rows, num_slots, dtype=torch.bool, **kw)
        self.slot = torch.full((rows, r_max), -1, dtype=i32, **kw)
        self.layout = ExecLayout.empty(rows, r_max, device)
        self.admitted = torch.full((rows, r_max), -1, dtype=i32, **kw)
        self.evicted = torch.full((rows, r_max), -1, dtype=i32, **kw)
        self.counts = torch.zeros(4, dtype=torch.int64, **kw)  # hits, misses, hit/miss rows
        self.bookkeeper = PolicyBookkeeper(rows, num_slots, policy)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._parts: dict[tuple[int, int], BufferRows] = {}

    # -- device work of one step (fixed shapes) ----------------------------------------
    def part(self, start: int, stop: int) -> BufferRows:
        """The step's device work over rows ``start:stop`` (kept per range)."""
        rows = self._parts.get((start, stop))
        if rows is None:
            rows = self._parts[(start, stop)] = BufferRows(self, start, stop)
        return rows

    @property
    def whole(self) -> BufferRows:
        """The step's device work over every row."""
        return self.part(0, self.rows)

    # -- between steps (host) ----------------------------------------------------------
    def begin_step(self) -> None:
        """Install the newest victim list the policy worker published, if any."""
        fresh = self.bookkeeper.take_victims()
        if fresh is not None:
            self.victims.copy_(fresh, non_blocking=True)
            self.consumed.zero_()

    def finish_step(self) -> None:
        """Copy the step's record to the host and queue it for the policy worker."""
        layout = self.layout
        parts = [layout.ids, self.slot, self.admitted, self.evicted, layout.count]
        if self.device.type == "cuda":
            host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
            for h, p in zip(host, parts, strict=True):
                h.copy_(p, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = [p.clone() for p in parts], None
        self.bookkeeper.submit(StepRecord(*host, ready=ready))

    @property
    def stats(self) -> BufferStats:
        """Hits and misses so far (synchronises with the device)."""
        h, m, hr, mr = self.counts.tolist()
        return BufferStats(hits=h, misses=m, hit_rows=hr, miss_rows=mr)

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after warm-up)."""
        self.counts.zero_()

    def close(self) -> None:
        """Stop the policy worker and return the GPU budget; safe to repeat."""
        self.bookkeeper.close()
        if self.account is not None:
            self.account.release(self.num_bytes)
            self.account = None
