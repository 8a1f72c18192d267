"""The wave buffer: a per-layer GPU block cache in front of offloaded KV, and the execution buffer.

Per step, after the retrieved clusters are chosen (:class:`~vecstore.kernels.zones.Zones`):

1. :meth:`WaveBuffer.lookup` reads each retrieved cluster's slot from the GPU slot table
   (hits and misses per (sequence, KV head) row, no host round trip) and lays out the
   execution buffer: a row's hits first (rows ``0:split``), then its misses
   (``split:total``).
2. :meth:`WaveBuffer.map_hits` maps the hits' places to their cache rows (``hit_map``: the
   executor reads hits in place, nothing is copied), and :meth:`WaveBuffer.fill_misses`
   copies misses from the KV rows in pinned host memory into the execution buffer on a
   side CUDA stream. The executor attends the hits while the misses are copied.
3. :meth:`WaveBuffer.plan_admission` gives misses the next usable slots of the victim list,
   and :meth:`WaveBuffer.admit` copies them into the cache from the execution buffer once
   they have arrived: no cluster crosses PCIe twice. Clusters larger than a slot are never
   cached.
4. :meth:`WaveBuffer.finish_step` hands the step's record to the
   :class:`~vecstore.buffer.bookkeeping.PolicyBookkeeper` (policy on a CPU thread), and
   :meth:`WaveBuffer.begin_step` installs the newest victim list it published.

Steps 1-3 are plain device work of fixed shapes (CUDA-graph capturable), the kernels of
:mod:`vecstore.kernels.slot_table`, :mod:`vecstore.kernels.hit_map` and
:mod:`vecstore.kernels.cluster_copy` (imported at their first launch: ``triton`` is an
optional dependency); 4 runs between steps. Before its first step a buffer takes over the
cache of the view its own extends (after a segment flush) and fills its free slots
(:mod:`vecstore.buffer.cache_fill`). Rows are ``b * Hkv + h``.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from vecstore.buffer.bookkeeping import PolicyBookkeeper, RecordPool, StepRecord
from vecstore.kernels.exec_layout import ExecLayout
from vecstore.kernels.slot_scratch import AdmissionScratch
from vecstore.kernels.zones import Zones
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

    def __add__(self, other: BufferStats) -> BufferStats:
        """The counters of two buffers summed.

        Examples
        --------
        >>> (BufferStats(3, 1, 40, 9) + BufferStats(1, 3, 10, 30)).hit_rate
        0.5
        """
        return BufferStats(self.hits + other.hits, self.misses + other.misses,
                           self.hit_rows + other.hit_rows, self.miss_rows + other.miss_rows)


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
        Replacement policy name (:data:`vecstore.policies.POLICIES`).
    account : MemoryAccount, optional
        GPU budget charged for the cache and buffers (a store's ``kvstore.gpu_budget_gb``
        for ``device``); checked before allocating.
    policy_worker : concurrent.futures.Executor, optional
        Where the policy's records are applied, shared by the buffers of an executor (one
        thread for all offloaded layers, not a thread each competing for the GIL with the
        decode loop); by default a thread of the buffer's own.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, *, num_clusters: int,
                 r_max: int, exec_rows: int, num_slots: int, slot_tokens: int,
                 device: torch.device, policy: str = "lru",
                 account: MemoryAccount | None = None,
                 policy_worker: Executor | None = None) -> None:
        rows, _, dim = keys.shape
        self.keys, self.values = keys, values
        self.rows, self.num_clusters, self.num_slots = rows, num_clusters, num_slots
        self.slot_tokens, self.r_max = slot_tokens, r_max
        self.device = device
        row_bytes = 2 * dim * keys.element_size()
        self.num_bytes = rows * (row_bytes * (num_slots * slot_tokens + exec_rows)
                                 + 4 * (num_clusters + 3 + 2 * (num_slots + 1) + 5 * r_max
                                        + exec_rows)  # the hit map
                                 + 5 * num_slots)  # the admission's scratch
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
        self.hit_map = torch.zeros(rows, exec_rows, dtype=torch.int32, **kw)
        i32 = torch.int32
        self.slot_of = torch.full((rows, num_clusters + 1), -1, dtype=i32, **kw)  # col C: dump
        self.owner = torch.full((rows, num_slots + 1), -1, dtype=i32, **kw)  # col S: dump
        self.victims = torch.arange(num_slots, dtype=i32, **kw).repeat(rows, 1)
        self.consumed = torch.zeros(rows, num_slots, dtype=torch.bool, **kw)
        self.slot = torch.full((rows, r_max), -1, dtype=i32, **kw)
        self.layout = ExecLayout.empty(rows, r_max, device)
        self._scratch = AdmissionScratch.empty(rows, num_slots, device)
        self.admitted = torch.full((rows, r_max), -1, dtype=i32, **kw)
        self.evicted = torch.full((rows, r_max), -1, dtype=i32, **kw)
        # hits, misses, hit rows, miss rows on the device (stats reads them)
        self.counts = torch.zeros(4, dtype=torch.int64, **kw)
        self.bookkeeper = PolicyBookkeeper(rows, num_slots, policy, executor=policy_worker)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._misses_done: torch.cuda.Event | None = None
        self._zones: Zones | None = None
        self._records: RecordPool | None = None  # pinned step records (CUDA)

    # -- device work of one step (fixed shapes) ----------------------------------------
    def lookup(self, zones: Zones) -> None:
        """Find each retrieved cluster's slot (-1 = miss), place it in the execution buffer
        (hits first) and count hits and misses."""
        from vecstore.kernels.slot_table import lookup_slots

        self._zones = zones
        lookup_slots(zones, self.slot_of, self.slot, self.layout, self.counts)

    def map_hits(self) -> None:
        """Map each hit's places in the execution buffer (``0:split`` of a row) to its rows
        in the cache, ``hit_map`` (current stream): the hits are read where they are."""
        from vecstore.kernels.hit_map import map_hits

        map_hits(self.layout, self.slot, self.hit_map, self.slot_tokens)

    def fill_misses(self) -> None:
        """Copy misses from host memory into the execution buffer, on the copy stream."""
        if self.copy_stream is None:
            self._copy_misses()
            return
        main = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(main)
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
        from vecstore.kernels.slot_table import plan_admission

        assert self._zones is not None
        plan_admission(self._zones, self.slot, self.victims, self.consumed, self.owner,
                       self.slot_of, self.admitted, self.evicted, self.slot_tokens,
                       self._scratch)

    def admit(self) -> None:
        """Copy the misses :meth:`plan_admission` gave a slot from the execution buffer into
        the cache: after the misses have arrived (:meth:`wait_misses`) and before the next
        :meth:`lookup`."""
        from vecstore.kernels.cluster_copy import copy_clusters

        copy_clusters(1, self.layout, self.admitted, None, self.exec_k, self.exec_v,
                      self.cache_k, self.cache_v, self.slot_tokens)

    def _copy_misses(self) -> None:
        from vecstore.kernels.cluster_copy import copy_clusters

        assert self._zones is not None
        copy_clusters(0, self.layout, self.slot, self._zones.first_row, self.keys,
                      self.values, self.exec_k, self.exec_v, self.slot_tokens)

    # -- between steps (host) ----------------------------------------------------------
    def begin_step(self) -> None:
        """Install the newest victim list the policy worker published, if any."""
        fresh = self.bookkeeper.take_victims()
        if fresh is not None:
            self.victims.copy_(fresh, non_blocking=True)
            self.consumed.zero_()

    def finish_step(self) -> None:
        """Copy the step's record to the host and queue it for the policy worker."""
        zones = self._zones
        assert zones is not None
        parts = [zones.ids, self.slot, self.admitted, self.evicted, zones.count]
        if self.device.type != "cuda":
            self.bookkeeper.submit(StepRecord(*[p.clone() for p in parts], ready=None))
            return
        if self._records is None:
            self._records = RecordPool(parts)
        record = self._records.take()
        host = [record.ids, record.slot, record.admitted, record.evicted, record.count]
        for h, p in zip(host, parts, strict=True):
            h.copy_(p, non_blocking=True)
        assert record.ready is not None
        record.ready.record()
        self._records.track(record, self.bookkeeper.submit(record))

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
