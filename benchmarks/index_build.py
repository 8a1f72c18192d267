"""Wave index build (segmented spherical k-means) per layer vs that layer's causal prefill.

Llama-3-8B attention shape (32 q heads, 8 KV heads, d=128, bf16). For each context, the
time of ``WaveIndex.build`` over one layer's keys (every clusterer available on the GPU)
and of the same layer's causal prefill attention (torch SDPA, flash kernel), both on the
GPU, medians of wall-clock time around synchronised calls. Bytes: the build reads the
layer's keys at least once per k-means iteration (``build_<kind>_gbs`` is that lower bound
over the build time, against the HBM copy bandwidth measured at the start of the run), and
its peak GPU memory above the inputs is ``build_<kind>_peak_gb``. ``--device cpu`` runs
the same on the CPU (a smoke run: no ceilings, no memory figures).

Writes ``index_build.{json,md,png}`` under ``--out`` (default ``benchmarks/results``).

    python benchmarks/index_build.py [--contexts 131072 1048576] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    Timer,
    ceilings,
    machine,
    plot_pairs,
    write_results,
)
from vecstore.cluster import CLUSTERERS  # noqa: E402
from vecstore.config import StoreConfig  # noqa: E402
from vecstore.errors import BackendUnavailableError  # noqa: E402
from vecstore.index.wave import WaveIndex  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def wall(fn, reps: int, warmup: bool, dev: torch.device) -> float:
    """Median seconds of ``fn`` (synchronised on ``dev``), after one warm-up call if asked."""
    if warmup:
        fn()
        _sync(dev)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def keys_read_gb(tokens: int, iterations: int) -> float:
    """GB of bf16 keys ``[HKV, tokens, D]`` read once per k-means iteration: the build's
    bytes, at least."""
    return iterations * HKV * tokens * D * 2 / 1e9


def plot(rows: list[dict], path: Path) -> None:
    """Seconds per layer: causal prefill attention against each clusterer's index build."""
    kinds = [k for k in ("torch", "cupy") if any(f"build_{k}_s" in r for r in rows)]
    plot_pairs(path, [f"{r['context'] // 1024}K" for r in rows],
               {"prefill attention": [r["prefill_attention_s"] for r in rows],
                **{f"index build ({k})": [r.get(f"build_{k}_s", 0.0) for r in rows]
                   for k in kinds}},
               "seconds per layer", "wave index build vs causal prefill attention", log=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    dev = torch.device(args.device)
    ceil = ceilings(dev, Timer(dev)) if dev.type == "cuda" else {}
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for tokens in args.contexts:
        centres = torch.randn(HKV, tokens // 64, D, generator=gen, device=dev)
        pick = torch.randint(0, centres.shape[1], (HKV, tokens), generator=gen, device=dev)
        keys = (torch.gather(centres, 1, pick[..., None].expand(-1, -1, D))
                + 0.5 * torch.randn(HKV, tokens, D, generator=gen, device=dev)).bfloat16()
        values = torch.randn(HKV, tokens, D, generator=gen, device=dev).bfloat16()
        q = torch.randn(1, HQ, tokens, D, generator=gen, device=dev).bfloat16()
        # long contexts: one repeat, kernels already warm from the shorter ones
        reps, warm = (3, True) if tokens <= 262144 else (1, not rows)
        prefill = wall(lambda q=q, k=keys, v=values: F.scaled_dot_product_attention(
            q, k[None], v[None], is_causal=True, enable_gqa=True), reps, warm, dev)
        flops = 4 * tokens * tokens * D * HQ / 2
        row = {"context": tokens, "prefill_attention_s": prefill,
               "prefill_tflops": flops / prefill / 1e12}
        for kind in ("torch", "cupy"):
            if kind not in CLUSTERERS.names():
                continue
            cfg = StoreConfig.from_dict({"cluster": {"kind": kind}})
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            try:
                index = WaveIndex(cfg)
                build = wall(lambda index=index, k=keys, v=values: index.build(k, v, 4), reps,
                             warm, dev)
            except (ImportError, RuntimeError, BackendUnavailableError) as exc:
                print(f"{kind}: {exc}", flush=True)
                continue
            row[f"build_{kind}_s"] = build
            row[f"build_{kind}_over_prefill"] = build / prefill
            row[f"build_{kind}_gbs"] = keys_read_gb(tokens, cfg.index.kmeans_iters) / build
            if dev.type == "cuda":
                row[f"build_{kind}_peak_gb"] = (torch.cuda.max_memory_allocated(dev)
                                                - base) / 1e9
        rows.append(row)
        print(row, flush=True)
        del keys, values, q, centres, pick
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    meta = {**machine(), **ceil, "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D,
                                    "dtype": "bfloat16"},
            "index": "segments of 8192 tokens, 16 tokens per cluster, 10 iterations",
            "timing": "wall clock around synchronised calls, median (3 repeats; 1 at 1M)"}
    cols = ["context", "prefill_attention_s", "prefill_tflops", "build_torch_s",
            "build_torch_over_prefill", "build_torch_gbs", "build_torch_peak_gb",
            "build_cupy_s", "build_cupy_over_prefill", "build_cupy_gbs", "build_cupy_peak_gb"]
    write_results(args.out, "index_build", meta, rows, cols,
                  "Wave index build per layer vs causal prefill attention")
    plot(rows, args.out / "index_build.png")
    print("\n" + (args.out / "index_build.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
