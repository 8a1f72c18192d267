"""Shared helpers of the GPU benchmarks: timing, ceilings, synthetic wave views, results.

Timing follows BENCHMARKS.md: warm-up, CUDA events around the measured region only,
the L2 cache (60 MB on the H200) flushed before every repeat, medians, variants
interleaved A B A B in one process.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vecstore.index.base import IndexView

__all__ = ["Timer", "ceilings", "synthetic_view", "machine", "write_results", "RESULTS",
           "LONG_SLEEP_CYCLES"]

RESULTS = Path(__file__).parent / "results"
_SLEEP_CYCLES = 100_000  # ~50 us at the H200's ~2 GHz
# ~0.5 ms: longer than the host takes to launch an offloaded step's graph (about 110 nodes
# on four streams; the profiler showed ~60 us of it past a 50 us sleep)
LONG_SLEEP_CYCLES = 1_000_000


class Timer:
    """Median CUDA-event time of callables, L2 flushed before each repeat."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)

    def times(self, fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 3,
              device_only: tuple[str, ...] = ()) -> dict[str, float]:
        """Median milliseconds of each callable, interleaved ``reps`` times.

        For the callables named in ``device_only`` the device idles ~50 us on a sleep kernel
        before the start event, so the host has enqueued the work before the device reaches
        it: their time is device time alone, without the host's launch latency (the others
        include it, as a caller waiting on them would see).
        """
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        torch.cuda.synchronize()
        out: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                self._flush.zero_()
                if name in device_only:
                    torch.cuda._sleep(_SLEEP_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out[name].append(start.elapsed_time(end))
        return {k: statistics.median(v) for k, v in out.items()}


def ceilings(device: torch.device, timer: Timer) -> dict[str, float]:
    """Measured HBM copy (read + write) and pinned / pageable host-to-device bandwidth, GB/s."""
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True).random_()
    pageable = torch.empty(2**30, dtype=torch.uint8).random_()
    dev = torch.empty(2**30, dtype=torch.uint8, device=device)
    t = timer.times({
        "hbm": lambda: dst.copy_(src),
        "pinned": lambda: dev.copy_(host, non_blocking=True),
        "pageable": lambda: dev.copy_(pageable),
    }, reps=5, warmup=1)
    return {"hbm_copy_gbs": 2 * n / t["hbm"] / 1e6, "pinned_h2d_gbs": 2**30 / t["pinned"] / 1e6,
            "pageable_h2d_gbs": 2**30 / t["pageable"] / 1e6}


def synthetic_view(batch: int, tokens: int, heads: int, dim: int, *, tokens_per_cluster: int,
                   device: torch.device, dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0) -> IndexView:
    """A wave view of ``batch`` sequences of ``tokens`` clustered keys, built without k-means.

    Cluster sizes are uniform in ``[tpc / 2, 3 tpc / 2]``; keys are the cluster's centre plus
    noise, so scores are peaked as with real keys; centroids, radii and value sums are exact
    means, largest distances and sums of the rows, as the wave index stores them. Timing does
    not depend on the data.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    lo, hi = tokens_per_cluster // 2, tokens_per_cluster * 3 // 2
    num = tokens // tokens_per_cluster
    sizes = torch.randint(lo, hi + 1, (batch, heads, num), generator=gen, device=device)
    sizes = (sizes * tokens / sizes.sum(-1, keepdim=True)).long().clamp_min(1)
    # rows of a head sum to ``tokens``: the rounding remainder, one row each to the first
    # clusters (not all to the last, which would make one cluster thousands of rows long)
    rest = tokens - sizes.sum(-1, keepdim=True)
    sizes += (torch.arange(num, device=device) < rest).long()
    sizes[..., -1] += tokens - sizes.sum(-1)  # only if clamping made the sum overshoot
    offsets = torch.cat([sizes.new_zeros(batch, heads, 1), sizes.cumsum(-1)], dim=-1)
    keys = torch.empty(batch, heads, tokens, dim, dtype=dtype, device=device)
    values = torch.empty_like(keys)
    cents = torch.zeros(batch, heads, num, dim, device=device)
    vsums = torch.zeros_like(cents)
    radii = torch.zeros(batch, heads, num, device=device)
    for b in range(batch):
        for h in range(heads):
            unit = torch.repeat_interleave(torch.arange(num, device=device), sizes[b, h])
            centre = torch.randn(num, dim, generator=gen, device=device)
            k = centre[unit] + 0.5 * torch.randn(tokens, dim, generator=gen, device=device)
            v = torch.randn(tokens, dim, generator=gen, device=device)
            keys[b, h], values[b, h] = k.to(dtype), v.to(dtype)
            cents[b, h].index_add_(0, unit, keys[b, h].float())
            cents[b, h] /= sizes[b, h, :, None].clamp_min(1)
            vsums[b, h].index_add_(0, unit, values[b, h].float())
            spread = (keys[b, h].float() - cents[b, h, unit]).norm(dim=-1)
            radii[b, h].scatter_reduce_(0, unit, spread, "amax")
    return IndexView(keys=keys, values=values, offsets=offsets, sizes=sizes,
                     meta={"centroids": cents, "radii": radii, "value_sums": vsums},
                     num_units=torch.full((batch,), num))


def machine() -> dict[str, Any]:
    """Card, driver and library versions, and the date."""
    import triton

    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gib=round(p.total_memory
                                                                               / 2**30, 1))
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    return info


def print_row(row: dict[str, Any]) -> None:
    """Print a result row as it is measured, floats to four places."""
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def write_results(out_dir: Path, name: str, meta: dict[str, Any], rows: list[dict[str, Any]],
                  columns: list[str], title: str) -> None:
    """Write ``name.json`` (meta + rows) and ``name.md`` (a table of ``columns``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# {title}", "", f"{meta.get('gpu', 'cpu')}, {meta.get('date')}, torch "
             f"{meta.get('torch')}, triton {meta.get('triton')}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def plot_pairs(path: Path, labels: list[str], pairs: dict[str, list[float]], ylabel: str,
               title: str, *, log: bool = False) -> None:
    """Grouped bars: one group per label, one bar per series of ``pairs`` (to ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(pairs)
    for i, (series, values) in enumerate(pairs.items()):
        xs = [j + (i - (len(pairs) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=series)
    ax.set_xticks(range(len(labels)), labels)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)
