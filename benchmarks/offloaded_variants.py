"""A/B the offloaded wave decode step (KV in pinned host memory) under variants, on one GPU.

Like ``variants.py`` for the resident step: each variant is a name and settings
``module.ATTR=value`` applied while its executor prepares the view (its own wave buffer and
block cache) and captures the step, at one size a run. Every variant's first step is checked
against the torch reference on the same rows in device memory; then the variants replay in
turn, each with queries drifting as in ``decode.py`` (``q_t = 0.97 q_{t-1} + noise``) and its
cache warm, every step queued behind a device sleep (device time). Reports the median step,
the miss bytes per step and microseconds per miss megabyte.

    python benchmarks/offloaded_variants.py --size 1x1048576 \\
        --variant base \\
        --variant merge16 vecstore.kernels.merge_parts._COMBINE_BLOCK=16

Writes ``offloaded_variants.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.variants import (  # noqa: E402
    Setting,
    applied,
    describe,
    parse_setting,
    parse_size,
)


def run(batch: int, tokens: int, variants: list[tuple[str, list[Setting]]], steps: int,
        warm: int) -> list[dict[str, Any]]:
    """Check, then time every variant's offloaded step at one size; a row per variant."""
    from benchmarks import decode_setup as dec
    from benchmarks.common import LONG_SLEEP_CYCLES
    from vecstore.executor.torch_ref import TorchExecutor
    from vecstore.executor.wave_exec import WaveExecutor
    from vecstore.index.wave import WaveIndex

    dev = torch.device("cuda")
    view, steady, q = dec.make_inputs(batch, tokens, dev, seed=batch * 11 + tokens % 89)
    q4 = q[:, :, None]
    ref = TorchExecutor(dev.type).run(WaveIndex(dec.CFG), view, steady, q4, dec.SCALE,
                                      dec.LAYER)
    pinned, rows, off = dec.pinned_view(view)
    del view
    torch.cuda.empty_cache()
    runs = []
    for name, settings in variants:
        with applied(settings):
            ex, index = WaveExecutor(dev.type), WaveIndex(dec.CFG)
            err = dec.rel_err(ex.run(index, off, steady, q4, dec.SCALE, dec.LAYER)[0], ref[0])
            prep = ex.prepare(off, dec.LAYER, index)
            buf = prep.buffer
            assert buf is not None
            buf.bookkeeper.wait()
            qs = q.contiguous().clone()
            graph, _ = dec.capture(lambda ex=ex, prep=prep, qs=qs: ex.decode(prep, steady, qs,
                                                                             dec.SCALE))
        # the executor and its prepared view stay alive: the graph reads their tensors
        runs.append({"name": name, "settings": settings, "err": err, "ex": ex, "prep": prep,
                     "buf": buf, "qs": qs, "graph": graph, "ms": [], "miss_rows": []})
    gen = torch.Generator(device=dev).manual_seed(5)
    for step in range(steps):
        for r in runs:
            buf = r["buf"]
            r["qs"].copy_(dec.drift(r["qs"], gen, 0.97))
            before = buf.stats.miss_rows
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            buf.begin_step()
            torch.cuda._sleep(LONG_SLEEP_CYCLES)  # the replay is queued when the device starts
            start.record()
            r["graph"].replay()
            end.record()
            buf.finish_step()
            end.synchronize()
            if step >= warm:
                r["ms"].append(start.elapsed_time(end))
                r["miss_rows"].append(buf.stats.miss_rows - before)
    out = []
    for r in runs:
        miss_mb = statistics.mean(r["miss_rows"]) * dec.D * 2 * 2 / 1e6  # K and V, bf16
        ms = statistics.median(r["ms"])
        out.append({"batch": batch, "context": tokens, "variant": r["name"], "ms": ms,
                    "min_ms": min(r["ms"]), "miss_mb": miss_mb,
                    "us_per_miss_mb": ms * 1e3 / miss_mb, "err": r["err"],
                    "settings": describe(r["settings"])})
        r["buf"].close()
    pinned.free(rows)
    return out


def main() -> None:
    from benchmarks.common import RESULTS, machine, print_row, write_results

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1x1048576", help="BATCHxCONTEXT")
    parser.add_argument("--variant", nargs="+", action="append", required=True,
                        metavar=("NAME", "MODULE.ATTR=VALUE"),
                        help="a name, then its settings (none: the code as it is)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warm", type=int, default=30, help="untimed steps first")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    try:
        variants = [(v[0], [parse_setting(s) for s in v[1:]]) for v in args.variant]
        batch, tokens = parse_size(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 <= args.warm < args.steps:
        parser.error(f"--warm must be at least 0 and below --steps ({args.steps})")
    rows = run(batch, tokens, variants, args.steps, args.warm)
    for r in rows:
        print_row(r)
    write_results(args.out, "offloaded_variants", machine(), rows,
                  ["batch", "context", "variant", "ms", "min_ms", "miss_mb", "us_per_miss_mb",
                   "err", "settings"], "Offloaded wave decode step under variants")


if __name__ == "__main__":
    main()
