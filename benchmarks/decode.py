"""Decode attention of one layer, Llama-3-8B shape (32 q heads, 8 KV heads, d=128, bf16).

Checks correctness first (the wave executor against the torch reference executor, same
plan), then times, interleaved in one process:

- ``sdpa``: torch SDPA full attention over the GPU-resident KV (the baseline);
- ``wave``: the wave executor's decode step captured in a CUDA graph, KV on the GPU
  (these two are device time: the host enqueues them while the device sleeps);
- ``wave_run``: ``WaveExecutor.run`` as the Store calls it (inputs copied into the step's
  CUDA graph, replay, one stats sync); ``wave_eager``: the same without graphs;
- ``torch_ref``: the plain torch reference executor (one size only);
- offloaded: KV in pinned host memory behind the GPU block cache, queries drifting from
  step to step (device time on even steps, queued behind a device sleep as above; wall time
  on odd steps), against its floor (miss bytes / pinned bandwidth + GPU bytes / HBM
  bandwidth) and against full attention streaming the KV from pinned memory; and the
  cache hit rate of every replacement policy.

Writes ``decode.{json,md,png}`` under ``--out`` (default ``benchmarks/results``).

    python benchmarks/decode.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    LONG_SLEEP_CYCLES,
    RESULTS,
    Timer,
    ceilings,
    machine,
    print_row,
    write_results,
)
from benchmarks.decode_setup import (  # noqa: E402
    CFG,
    HKV,
    HQ,
    LAYER,
    SCALE,
    STEADY_CAP,
    TPC,
    D,
    capture,
    drift,
    full_attention,
    ideal_bytes,
    make_inputs,
    pinned_view,
    rel_err,
)
from vecstore.executor.torch_ref import TorchExecutor  # noqa: E402
from vecstore.executor.wave_exec import WaveExecutor  # noqa: E402
from vecstore.index.wave import WaveIndex  # noqa: E402


def resident(timer: Timer, ceil: dict[str, float], batch: int, tokens: int, dev: torch.device,
             with_torch_ref: bool) -> dict:
    view, steady, q = make_inputs(batch, tokens, dev, seed=batch * 7 + tokens % 97)
    index = WaveIndex(CFG)
    q4 = q[:, :, None]
    # correctness against the reference: float32 scoring (the reference's plan) first
    ref = TorchExecutor(dev.type).run(index, view, steady, q4, SCALE, LAYER)
    exact = WaveExecutor(dev.type, score_dtype=torch.float32).run(index, view, steady, q4, SCALE,
                                                               LAYER)
    # the default step (int8 centroid codes) and the one scoring bfloat16 centroids
    ex = WaveExecutor(dev.type)
    exb = WaveExecutor(dev.type, score_dtype=torch.bfloat16)
    got = ex.run(index, view, steady, q4, SCALE, LAYER)
    gotb = exb.run(index, view, steady, q4, SCALE, LAYER)
    full = full_attention(view, steady, q)
    row = {"mode": "gpu", "batch": batch, "context": tokens,
           "err_f32_plan": rel_err(exact[0], ref[0]), "err": rel_err(got[0], ref[0]),
           "lse_err": rel_err(got[1], ref[1]), "err_bf16_scoring": rel_err(gotb[0], ref[0]),
           "exact_err_ref": rel_err(ref[0], full), "exact_err": rel_err(got[0], full),
           "exact_err_bf16_scoring": rel_err(gotb[0], full)}
    assert row["err_f32_plan"] < 1e-2 and row["err"] < 2e-2, row
    qs = q.contiguous()
    steps = {}
    for name, executor, answer in (("wave", ex, got), ("wave_bf16", exb, gotb)):
        prep = executor.prepare(view, LAYER, index)
        graph, res = capture(lambda e=executor, p=prep: e.decode(p, steady, qs, SCALE))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(res.out, answer[0][:, :, 0]) < 1e-3
        steps[name] = (graph, res, prep)
    eager = WaveExecutor(dev.type, use_graphs=False)
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q4, view.keys, view.values,
                                                       enable_gqa=True),
        "wave": steps["wave"][0].replay,
        "wave_bf16": steps["wave_bf16"][0].replay,
        "wave_run": lambda: ex.run(index, view, steady, q4, SCALE, LAYER),
        "wave_eager": lambda: eager.run(index, view, steady, q4, SCALE, LAYER),
    }
    if with_torch_ref:
        fns["torch_ref"] = lambda: TorchExecutor(dev.type).run(index, view, steady, q4, SCALE,
                                                            LAYER)
    t = timer.times(fns, reps=15, device_only=("sdpa", "wave", "wave_bf16"))
    hbm = ceil["hbm_copy_gbs"]
    sdpa_bytes = 2.0 * view.keys.numel() * 2
    row.update({f"{k}_ms": v for k, v in t.items()})
    for name, suffix in (("wave", ""), ("wave_bf16", "_bf16")):
        b = ideal_bytes(view, steps[name][1], steady, steps[name][2])
        wave_bytes = sum(v for k, v in b.items() if k.endswith("_bytes"))
        row[f"speedup{suffix}"] = t["sdpa"] / t[name]
        row[f"wave_floor{suffix}_ms"] = wave_bytes / hbm / 1e6
        if name == "wave":
            row.update(wave_bytes_mb=wave_bytes / 1e6, wave_gbs=wave_bytes / t["wave"] / 1e6,
                       byte_ratio=sdpa_bytes / wave_bytes,
                       **{k: v for k, v in b.items() if not k.endswith("_bytes")})
    row.update(speedup_run=t["sdpa"] / t["wave_run"], speedup_eager=t["sdpa"] / t["wave_eager"],
               sdpa_gbs=sdpa_bytes / t["sdpa"] / 1e6)
    if "torch_ref" in t:
        row["speedup_torch_ref"] = t["sdpa"] / t["torch_ref"]
    return row


def offloaded(timer: Timer, ceil: dict[str, float], batch: int, tokens: int,
              dev: torch.device, policy: str, steps: int, rho: float,
              stream_baseline: bool) -> dict:
    view, steady, q = make_inputs(batch, tokens, dev, seed=batch * 11 + tokens % 89)
    index = WaveIndex(CFG)
    pinned, rows, off = pinned_view(view)
    q4 = q[:, :, None]
    ref = TorchExecutor(dev.type).run(index, view, steady, q4, SCALE, LAYER)
    del view  # from here on the rows live in pinned memory only
    torch.cuda.empty_cache()
    ex = WaveExecutor(dev.type, cache_policy=policy)
    got = ex.run(index, off, steady, q4, SCALE, LAYER)
    row = {"mode": "offloaded", "policy": policy, "batch": batch, "context": tokens,
           "rho": rho, "err": rel_err(got[0], ref[0])}
    assert row["err"] < 2e-2, row
    prep = ex.prepare(off, LAYER, index)
    buf = prep.buffer
    assert buf is not None
    buf.bookkeeper.wait()
    qs = q.contiguous().clone()
    try:
        graph, res = capture(lambda: ex.decode(prep, steady, qs, SCALE))
        run = graph.replay
        row["graph"] = True
    except RuntimeError as exc:  # capture of the two-stream step failed: run eagerly
        print(f"  offloaded graph capture failed ({exc}); eager steps", flush=True)
        torch.cuda.synchronize()
        res = None
        row["graph"] = False

        def run():
            nonlocal res
            res = ex.decode(prep, steady, qs, SCALE)
    gen = torch.Generator(device=dev).manual_seed(5)
    wall, gpu, miss_rows, hit_rows, hits, misses, lag = [], [], [], [], [], [], []
    warm = steps // 2
    for step in range(steps):
        qs.copy_(drift(qs, gen, rho))
        before = buf.stats
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        buf.begin_step()
        timed = step % 2 == 0  # device time; odd steps give the wall time, launch included
        if timed:
            torch.cuda._sleep(LONG_SLEEP_CYCLES)  # the graph is queued when the device starts
        start.record()
        run()
        end.record()
        buf.finish_step()
        end.synchronize()
        t1 = time.perf_counter()
        after = buf.stats
        if step >= warm:
            if timed:
                gpu.append(start.elapsed_time(end))
            else:
                wall.append((t1 - t0) * 1e3)
            miss_rows.append(after.miss_rows - before.miss_rows)
            hit_rows.append(after.hit_rows - before.hit_rows)
            hits.append(after.hits - before.hits)
            misses.append(after.misses - before.misses)
            lag.append(buf.bookkeeper.lag)
    med = sorted(gpu)[len(gpu) // 2]
    b = ideal_bytes(off, res, steady, prep)
    mrows = sum(miss_rows) / len(miss_rows)
    miss_bytes = mrows * D * 2 * 2
    gpu_bytes = (b["centroid_bytes"] + b["estimated_bytes"] + b["steady_bytes"]
                 + b["retrieved_bytes"])
    floor = miss_bytes / ceil["pinned_h2d_gbs"] / 1e6 + gpu_bytes / ceil["hbm_copy_gbs"] / 1e6
    row.update(
        step_gpu_ms=med, step_wall_ms=sorted(wall)[len(wall) // 2],
        hit_rate=sum(hits) / max(1, sum(hits) + sum(misses)),
        miss_mb_per_step=miss_bytes / 1e6, floor_ms=floor, over_floor=med / floor,
        pcie_gbs=miss_bytes / med / 1e6, policy_lag_steps=sum(lag) / len(lag),
        pinned_gb=pinned.account.peak_bytes / 1e9, cache_slots=buf.num_slots,
        gpu_buffer_mb=buf.num_bytes / 1e6,
    )
    if stream_baseline:
        # full attention streaming the KV from pinned memory: at least one H2D of all of it
        dst = torch.empty(2**30 // 2, dtype=torch.bfloat16, device=dev)
        flat_k, flat_v = rows.keys.view(-1), rows.values.view(-1)

        def stream():
            for src in (flat_k, flat_v):
                for i in range(0, src.numel(), dst.numel()):
                    n = min(dst.numel(), src.numel() - i)
                    dst[:n].copy_(src[i:i + n], non_blocking=True)
        row["stream_full_ms"] = timer.times({"stream": stream}, reps=2, warmup=1)["stream"]
        row["speedup_vs_stream"] = row["stream_full_ms"] / med
    buf.close()
    pinned.free(rows)
    return row


def profile(batch: int, tokens: int, dev: torch.device, offload: bool, path: Path) -> None:
    """Append the per-kernel device times of three eager decode steps to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    view, steady, q = make_inputs(batch, tokens, dev, seed=3)
    pinned = None
    if offload:
        pinned, rows, view = pinned_view(view)
    ex = WaveExecutor(dev.type)
    prep = ex.prepare(view, LAYER, WaveIndex(CFG))
    qs = q.contiguous()
    for _ in range(3):
        ex.decode(prep, steady, qs, SCALE)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            ex.decode(prep, steady, qs, SCALE)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=22,
                                      max_name_column_width=60)
    with path.open("a") as fh:
        fh.write(f"\n## {'offloaded' if offload else 'gpu'} batch {batch} context {tokens}, "
                 "3 steps\n" + table)
    if prep.buffer is not None:
        prep.buffer.close()
    if pinned is not None:
        pinned.free(rows)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    gpu = [r for r in rows if r["mode"] == "gpu"]
    for batch in sorted({r["batch"] for r in gpu}):
        pts = sorted((r["context"], r["speedup"]) for r in gpu if r["batch"] == batch)
        ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], "o-", label=f"batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("speed-up over SDPA full attention")
    ax.axhline(1, color="grey", lw=0.5)
    ax.legend()
    ax.set_title("wave decode attention, GPU-resident KV (H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small sweep")
    parser.add_argument("--targets", action="store_true",
                        help="only the sizes the targets name, and LRU for the offloaded runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="skip remaining sizes after this many seconds")
    parser.add_argument("--profile", action="store_true",
                        help="first write per-kernel times of a few steps to profile.txt")
    args = parser.parse_args()
    dev = torch.device("cuda")
    t_start = time.time()
    timer = Timer(dev)
    ceil = ceilings(dev, timer)
    print("ceilings", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    if args.profile:
        args.out.mkdir(parents=True, exist_ok=True)
        for batch, tokens, off in ((8, 131072, False), (4, 1048576, False), (1, 1048576, True)):
            profile(batch, tokens, dev, off, args.out / "profile.txt")
            torch.cuda.empty_cache()
    sweep = [(32768, 8), (131072, 8)] if args.quick else [
        (131072, 8), (524288, 8), (1048576, 4), (131072, 32), (131072, 1), (1048576, 1),
        (32768, 8), (32768, 64), (1048576, 8)]
    if args.targets:
        sweep = [(131072, 8), (524288, 8), (1048576, 4), (1048576, 8), (131072, 1),
                 (1048576, 1), (131072, 32)]
    rows = []
    for tokens, batch in sweep:
        if time.time() - t_start > args.budget_s:
            print(f"skip gpu {tokens} x {batch}: time budget", flush=True)
            continue
        r = resident(timer, ceil, batch, tokens, dev, with_torch_ref=(tokens, batch) == (
            131072, 8))
        torch.cuda.empty_cache()
        rows.append(r)
        print_row(r)
    offload = [(1048576, 1, "lru", True), (131072, 8, "lru", True)]
    if args.targets:
        offload.insert(1, (1048576, 4, "lru", True))
    elif not args.quick:
        offload += [(131072, 4, p, False) for p in ("fifo", "lfu", "clock", "arc", "s3fifo")]
        offload.insert(1, (1048576, 4, "lru", True))
    for tokens, batch, policy, stream in offload:
        if time.time() - t_start > args.budget_s * 1.5:
            print(f"skip offloaded {tokens} x {batch} {policy}: time budget", flush=True)
            continue
        r = offloaded(timer, ceil, batch, tokens, dev, policy, steps=60, rho=0.97,
                      stream_baseline=stream)
        torch.cuda.empty_cache()
        rows.append(r)
        print_row(r)
    meta = {**machine(), **{k: round(v, 1) for k, v in ceil.items()},
            "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16",
                      "tokens_per_cluster": TPC, "steady_capacity": STEADY_CAP},
            "budgets": {"retrieval": LAYER.retrieval_budget,
                        "estimation": LAYER.estimation_budget, "cache": 0.05},
            "timing": "CUDA events, L2 flushed per repeat, median of 15 interleaved repeats; "
                      "sdpa and wave enqueued behind a ~50 us device sleep (device time); "
                      "offloaded steps: step_gpu_ms on even steps behind a ~0.5 ms device "
                      "sleep (device time), step_wall_ms on odd steps (host launch included)"}
    cols = ["mode", "policy", "batch", "context", "sdpa_ms", "wave_ms", "wave_run_ms",
            "wave_eager_ms", "torch_ref_ms", "speedup", "speedup_run", "speedup_eager",
            "wave_floor_ms", "wave_bf16_ms", "speedup_bf16", "wave_floor_bf16_ms",
            "wave_gbs", "sdpa_gbs",
            "byte_ratio", "step_gpu_ms", "step_wall_ms", "floor_ms", "over_floor", "hit_rate",
            "miss_mb_per_step", "pcie_gbs", "stream_full_ms", "speedup_vs_stream",
            "policy_lag_steps", "err", "err_bf16_scoring", "exact_err_ref", "exact_err",
            "exact_err_bf16_scoring"]
    write_results(args.out, "decode", meta, rows, cols, "Decode attention, one layer")
    plot(rows, args.out / "decode.png")
    print("\n" + (args.out / "decode.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
