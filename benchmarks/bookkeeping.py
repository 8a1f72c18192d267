"""Policy bookkeeping of the GPU block cache on the CPU: time to apply one step's record.

The wave buffer's worker thread applies each decode step's record (hits, admissions,
evictions per (sequence, KV head) row) to the replacement policy and publishes a victim
list. When it takes longer than a GPU step, it lags and the GPU admits by a stale list.
This times one record's application, with the per-row ``CachePolicy`` objects and with the
vectorised LRU/FIFO path (``vecstore.buffer.recency``), on records shaped like the H200
decode benchmark's: ``rows`` = sequences x 8 KV heads, ``C`` clusters a row, the
``k1 = 1.8 %`` best retrieved, a cache of 5 % of ``C`` slots, queries drifting so that about
14 % of the retrieved clusters change each step.

Writes ``bookkeeping.{json,md}`` under ``--out`` (default ``benchmarks/results``).

    python benchmarks/bookkeeping.py [--contexts 131072 1048576] [--batches 1 4 8]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine, write_results  # noqa: E402
from vecstore.buffer import PolicyBookkeeper, StepRecord, bookkeeping  # noqa: E402

HKV, TPC, RETRIEVAL, CACHE, CHURN = 8, 16, 0.018, 0.05, 0.14


class SimulatedGPU:
    """The device side of the block cache, as ``WaveBuffer`` does it, on numpy arrays."""

    def __init__(self, rows: int, clusters: int, slots: int, width: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.clusters, self.width = clusters, width
        self.slot_of = np.full((rows, clusters), -1, dtype=np.int32)
        self.owner = np.full((rows, slots), -1, dtype=np.int32)
        self.victims = np.tile(np.arange(slots, dtype=np.int32), (rows, 1))
        self.ids = np.stack([self.rng.choice(clusters, width, replace=False)
                             for _ in range(rows)]).astype(np.int32)

    def step(self) -> StepRecord:
        rows = self.ids.shape[0]
        rec = {k: np.full((rows, self.width), -1, dtype=np.int32)
               for k in ("slot", "admitted", "evicted")}
        for r in range(rows):
            change = self.rng.random(self.width) < CHURN
            self.ids[r, change] = self.rng.integers(0, self.clusters, int(change.sum()))
            ids = np.unique(self.ids[r])
            ids = np.concatenate([ids, self.rng.choice(
                np.setdiff1d(np.arange(self.clusters), ids), self.width - len(ids),
                replace=False)]) if len(ids) < self.width else ids
            self.ids[r] = ids = np.sort(ids).astype(np.int32)
            slot = self.slot_of[r, ids]
            rec["slot"][r] = slot
            used = np.zeros(self.owner.shape[1] + 1, dtype=bool)
            used[slot[slot >= 0]] = True
            usable = self.victims[r][~used[self.victims[r]]]
            misses = np.nonzero(slot < 0)[0][:len(usable)]
            for p, a in zip(misses, usable[:len(misses)], strict=True):
                old = self.owner[r, a]
                if old >= 0:
                    self.slot_of[r, old] = -1
                rec["admitted"][r, p], rec["evicted"][r, p] = a, old
                self.owner[r, a], self.slot_of[r, ids[p]] = ids[p], a
        t = {k: torch.from_numpy(v) for k, v in rec.items()}
        return StepRecord(torch.from_numpy(self.ids.copy()), t["slot"], t["admitted"],
                          t["evicted"], torch.full((rows,), self.width, dtype=torch.int32),
                          None)


def time_apply(rows: int, clusters: int, policy: str, vectorised: bool, steps: int,
               seed: int) -> tuple[float, float]:
    """Median milliseconds to apply one record, and the hit rate over the timed steps."""
    slots = max(1, math.ceil(CACHE * clusters))
    width = max(1, round(RETRIEVAL * clusters))
    gpu = SimulatedGPU(rows, clusters, slots, width, seed)
    saved = bookkeeping.RECENCY
    if not vectorised:
        bookkeeping.RECENCY = {}
    try:
        bk = PolicyBookkeeper(rows, slots, policy)
    finally:
        bookkeeping.RECENCY = saved
    times, hits, total = [], 0, 0
    for i in range(steps):
        rec = gpu.step()
        t0 = time.perf_counter()
        bk._apply(rec)
        dt = time.perf_counter() - t0
        gpu.victims = bk.take_victims().numpy()
        if i >= steps // 3:  # after the cache has filled
            times.append(dt * 1e3)
            hits += int((rec.slot >= 0).sum())
            total += rec.slot.numel()
    bk.close()
    return statistics.median(times), hits / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows_out = []
    for context in args.contexts:
        for batch in args.batches:
            for policy in ("lru", "fifo"):
                row = {"context": context, "batch": batch, "rows": batch * HKV,
                       "policy": policy}
                for vec in (False, True):
                    ms, hit = time_apply(batch * HKV, context // TPC, policy, vec,
                                         args.steps, seed=batch)
                    row["vectorised_ms" if vec else "per_row_policies_ms"] = ms
                    row["hit_rate"] = hit
                row["speedup"] = row["per_row_policies_ms"] / row["vectorised_ms"]
                print(row, flush=True)
                rows_out.append(row)
    meta = {**machine(), "threads": torch.get_num_threads(),
            "record": {"kv_heads": HKV, "tokens_per_cluster": TPC, "retrieval": RETRIEVAL,
                       "cache": CACHE, "churn": CHURN},
            "timing": "median of the steps after the first third, one process"}
    cols = ["context", "batch", "rows", "policy", "per_row_policies_ms", "vectorised_ms",
            "speedup", "hit_rate"]
    write_results(args.out, "bookkeeping", meta, rows_out, cols,
                  "Block-cache policy bookkeeping, one step's record (CPU)")


if __name__ == "__main__":
    main()
