"""Kernel timeline of the captured wave decode step: where the step's device time goes.

Replays the CUDA graph of one decode step (as ``decode.py`` times it: L2 flushed, the
device idle on a sleep kernel before the step) under the profiler, and writes, per size,
every kernel of the median step with its start and end relative to the step's first
kernel and its stream, then the step's span, the busy time of each stream and the time
no kernel ran. Offloaded sizes replay the step with drifting queries, the block cache
warm, as ``decode.py`` does.

    python benchmarks/timeline.py --sizes 8x131072 4x1048576 --out DIR
    python benchmarks/timeline.py --sizes --offloaded 1x1048576 --out DIR
    python benchmarks/timeline.py --sizes 4x1048576 \
        --set vecstore.executor.wave_streams._PIPELINE_GROUPS=2 --out DIR

``--set`` applies module-level launch constants for the whole run, as a variant of
``variants.py`` does. ``--captures N`` captures each resident size's step ``N`` times, each
with its own executor (a pipelined step's replay time differs between captures), times
every capture's replay and writes the timelines of the slowest and the fastest:

    python benchmarks/timeline.py --sizes 8x1048576 --captures 8 --out DIR

Each offloaded size frees its wave buffer and pinned rows once profiled, so several run in
one process (rows dropped unfreed stay registered with CUDA after their memory is unmapped,
and a second size then failed with ``cudaErrorAlreadyMapped``). Under the profiler the
offloaded step at 4 x 1M once ended in an illegal memory access that 40 steps without it
(synchronised or back to back) and ``decode.py`` did not show; 1 x 1M profiles cleanly.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import decode_setup as dec  # noqa: E402
from benchmarks.common import LONG_SLEEP_CYCLES, RESULTS, Timer  # noqa: E402
from benchmarks.variants import EXECUTOR, applied, parse_setting, parse_size  # noqa: E402
from vecstore.executor.wave_exec import WaveExecutor  # noqa: E402
from vecstore.index.base import IndexView  # noqa: E402
from vecstore.index.wave import WaveIndex  # noqa: E402

_MARK = "spin_kernel"  # torch.cuda._sleep's kernel: it opens every profiled step


def kernel_steps(trace: dict) -> list[list[dict]]:
    """The kernels of a chrome trace grouped into steps, each between two sleep kernels
    (one opens it, the next closes it); times in microseconds relative to the step's first
    kernel."""
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    steps: list[list[dict]] = []
    inside = False
    for e in kernels:
        if _MARK in e["name"]:
            inside = not inside
            if inside:
                steps.append([])
        elif inside:
            steps[-1].append(e)
    out = []
    for step in steps:
        if not step:
            continue
        t0 = step[0]["ts"]
        out.append([{"name": e["name"][:48], "stream": e.get("args", {}).get("stream", e["tid"]),
                     "start": e["ts"] - t0, "end": e["ts"] + e["dur"] - t0} for e in step])
    return out


def summarize(step: list[dict]) -> dict:
    """Span, per-stream busy time, and the time no kernel of the step ran (microseconds)."""
    span = max(e["end"] for e in step)
    busy: dict[str, float] = {}
    for e in step:
        busy[str(e["stream"])] = busy.get(str(e["stream"]), 0.0) + e["end"] - e["start"]
    idle, reach = 0.0, 0.0
    for e in sorted(step, key=lambda e: e["start"]):
        idle += max(0.0, e["start"] - reach)
        reach = max(reach, e["end"])
    return {"span_us": span, "busy_us": busy, "idle_us": idle, "kernels": len(step)}


# what runs before the step, the step, and what frees its resources once profiled
Step = tuple[Callable[[], None], Callable[[], None], Callable[[], None]]


def profiled(make: Step, reps: int) -> list[list[dict]]:
    from torch.profiler import ProfilerActivity, profile

    before, step, _ = make
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        before()
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            before()
            flush.zero_()
            torch.cuda._sleep(LONG_SLEEP_CYCLES)
            step()
            torch.cuda.synchronize()
            torch.cuda._sleep(1)
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        trace = json.loads(Path(fh.name).read_text())
    return kernel_steps(trace)


def median_step(steps: list[list[dict]]) -> list[dict]:
    spans = [max(e["end"] for e in s) for s in steps]
    mid = statistics.median_low(spans)
    return steps[spans.index(mid)]


def checked_graph(ex: WaveExecutor, view: IndexView, steady, q: torch.Tensor):
    """The step's CUDA graph, its output checked against ``WaveExecutor.run``'s."""
    index = WaveIndex(dec.CFG)
    want = ex.run(index, view, steady, q[:, :, None], dec.SCALE, dec.LAYER)[0][:, :, 0]
    prep = ex.prepare(view, dec.LAYER, index)
    if prep.buffer is not None:
        prep.buffer.bookkeeper.wait()
    qs = q.contiguous().clone()
    graph, res = dec.capture(lambda: ex.decode(prep, steady, qs, dec.SCALE))
    if prep.buffer is None:  # an offloaded step changes the cache: its replay is not the same
        graph.replay()
        torch.cuda.synchronize()
        err = dec.rel_err(res.out, want)
        assert err < 1e-3, f"graph output differs from run(): {err:.3g}"
    return graph, prep, qs


def resident_step(batch: int, tokens: int) -> Step:
    view, steady, q = dec.make_inputs(batch, tokens, torch.device("cuda"),
                                      seed=batch * 7 + tokens % 97)
    return captured(view, steady, q)


def captured(view: IndexView, steady, q: torch.Tensor) -> Step:
    """The resident step over these inputs, captured by an executor of its own."""
    ex = WaveExecutor("cuda", **EXECUTOR.kwargs())
    graph, prep, qs = checked_graph(ex, view, steady, q)
    # what the graph reads lives as long as the step: the last callable holds it
    return (lambda: None), graph.replay, (lambda keep=(ex, prep, qs, view, steady): None)


def capture_times(batch: int, tokens: int, n: int, reps: int) -> list[tuple[float, Step]]:
    """``n`` captures of the resident step of one size over the same inputs, each by an
    executor of its own: ``(median device ms of its replay, its Step)`` for each."""
    dev = torch.device("cuda")
    view, steady, q = dec.make_inputs(batch, tokens, dev, seed=batch * 7 + tokens % 97)
    timer = Timer(dev)
    out = []
    for _ in range(n):
        step = captured(view, steady, q)
        out.append((timer.times({"step": step[1]}, reps, device_only=("step",))["step"], step))
    return out


def offloaded_step(batch: int, tokens: int) -> Step:
    dev = torch.device("cuda")
    view, steady, q = dec.make_inputs(batch, tokens, dev, seed=batch * 11 + tokens % 89)
    pinned, rows, off = dec.pinned_view(view)
    del view
    torch.cuda.empty_cache()
    ex = WaveExecutor(dev.type, **EXECUTOR.kwargs())
    graph, prep, qs = checked_graph(ex, off, steady, q)
    buf = prep.buffer
    assert buf is not None
    gen = torch.Generator(device=dev).manual_seed(5)

    def before() -> None:
        qs.copy_(dec.drift(qs, gen, 0.97))

    def step() -> None:
        buf.begin_step()
        graph.replay()
        buf.finish_step()

    def done(keep=(ex, prep, steady)) -> None:  # what the graph reads lives until here
        torch.cuda.synchronize()
        buf.close()
        pinned.free(rows)

    for _ in range(16):  # the cache reaches its steady state
        before()
        step()
    return before, step, done


def report(label: str, step: list[dict]) -> str:
    s = summarize(step)
    lines = [f"## {label}: span {s['span_us']:.1f} us, no kernel running {s['idle_us']:.1f} us, "
             f"{s['kernels']} kernels, busy per stream "
             + ", ".join(f"{k}: {v:.1f}" for k, v in s["busy_us"].items())]
    lines += [f"{e['start']:8.1f} {e['end']:8.1f} {e['end'] - e['start']:7.1f}  "
              f"s{e['stream']}  {e['name']}" for e in step]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["8x131072", "4x1048576"])
    parser.add_argument("--offloaded", nargs="*", default=[])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--captures", type=int, default=1,
                        help="captures of each resident size; the slowest and fastest are "
                             "profiled")
    parser.add_argument("--set", nargs="*", default=[], metavar="MODULE.ATTR=VALUE",
                        help="launch constants to apply, as in variants.py")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    try:
        settings = [parse_setting(s) for s in args.set]
    except ValueError as exc:
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    with applied(settings):
        write_timelines(args)


def write_timelines(args: argparse.Namespace) -> None:
    """Profile every size of ``args`` and write ``timeline.{txt,json}`` under ``args.out``."""
    text, rows = [], []
    for size in args.sizes if args.captures > 1 else []:
        batch, tokens = parse_size(size)
        caps = capture_times(batch, tokens, args.captures, reps=15)
        times = [ms for ms, _ in caps]
        listed = ", ".join(f"{t:.3f}" for t in times)
        print(f"gpu {batch} x {tokens}: captures {listed} ms", flush=True)
        for which, i in (("slowest", times.index(max(times))),
                         ("fastest", times.index(min(times)))):
            step = median_step(profiled(caps[i][1], args.reps))
            text.append(report(f"gpu {batch} x {tokens}, {which} of {len(times)} captures "
                               f"({times[i]:.3f} ms; all: {listed})", step))
            rows.append({"mode": "gpu", "batch": batch, "context": tokens, "capture": which,
                         "capture_ms": times, **summarize(step), "timeline": step})
            print(text[-1], flush=True)
        del caps
        gc.collect()
        torch.cuda.empty_cache()
    for mode, sizes, make in (("gpu", args.sizes if args.captures <= 1 else [], resident_step),
                              ("offloaded", args.offloaded, offloaded_step)):
        for size in sizes:
            batch, tokens = parse_size(size)
            made = make(batch, tokens)
            step = median_step(profiled(made, args.reps))
            made[2]()
            del made
            text.append(report(f"{mode} {batch} x {tokens}", step))
            rows.append({"mode": mode, "batch": batch, "context": tokens,
                         **summarize(step), "timeline": step})
            print(text[-1], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    (args.out / "timeline.txt").write_text("\n".join(text))
    (args.out / "timeline.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
