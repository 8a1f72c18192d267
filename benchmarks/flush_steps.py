"""Decode steps through ``WaveCache`` across segment flushes: every step's wall time.

A wave cache decodes most steps as one replayed CUDA graph; the step whose token makes the
tails index a segment (every ``attention.update_tokens`` = 1,024 tokens) runs the model's
forward eagerly, the tails' segment is clustered and placed, the executor prepares the grown
views, and the next step captures the graph again. This times each step on its own (a
synchronised start and end) after a prompt of ``--context`` random tokens, reports the
median step and the slowest ones (the flushes, the first steps), the Triton kernels each step
compiled (a new specialization in this process: a kernel argument crossing a multiple of 16,
a block size doubling) and how long each took, and writes a ``cProfile`` of the host's time
over all steps after the first ``WARMUP``. ``wave-pinned`` rows also give the block caches'
``hit_rate`` over every step, with ``--cache-capacity`` their size (a flush hands a cache
to the grown view: at a large capacity, the flush steps show what it saves).

    python benchmarks/flush_steps.py [--layers 4] [--batch 8] [--context 16384]
        [--steps 2200] [--caches wave wave-pinned] [--cache-capacity 1.0]
        [--shape llama-3-8b] [--device cuda] [--out DIR]

Writes ``flush_steps.{json,md}`` and ``flush_steps_profile_<cache>.txt`` under ``--out``
(default ``benchmarks/results``). Triton's disk cache carries compiled kernels from one run
to the next: compare runs made on equally fresh machines.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine, write_results  # noqa: E402
from benchmarks.e2e import prefill  # noqa: E402
from benchmarks.e2e_models import (  # noqa: E402
    MODELS,
    block_cache_hit_rate,
    build_model,
    make_cache,
    make_step,
)

WARMUP = 5  # steps left out of the profile (the first compiles and captures)
SLOWEST = 8


class CompileLog:
    """The Triton kernels compiled while :meth:`at` a step: ``(step, kernel, seconds)``
    (through ``triton.knobs.runtime``'s JIT hooks; nothing where Triton is absent)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, str, float]] = []
        self._step = -1
        self._started: dict[object, float] = {}
        self._last: dict[str, object] = {}  # each kernel's last specialization key

    def _enter(self, *, key, fn, **_) -> bool:
        self._started[(fn.name, str(key))] = time.perf_counter()
        return False  # compile: a true value would skip it

    def _done(self, *, key, fn, compile=None, **_) -> None:
        t0 = self._started.pop((fn.name, str(key)), None)
        if t0 is None:
            return
        name, old = fn.name, self._last.get(fn.name)
        self._last[name] = compile
        changed = _changed(fn, old, compile) if old is not None else ""
        self.entries.append((self._step, name + (f" ({changed})" if changed else ""),
                             time.perf_counter() - t0))

    @contextmanager
    def hooks(self):
        try:
            from triton import knobs
        except ImportError:
            yield self
            return
        rt = knobs.runtime
        old = rt.jit_cache_hook, rt.jit_post_compile_hook
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._enter, self._done
        try:
            yield self
        finally:
            rt.jit_cache_hook, rt.jit_post_compile_hook = old

    def at(self, step: int) -> None:
        self._step = step

    def summary(self) -> str:
        """``step: kernel seconds, ...`` in step order."""
        return ", ".join(f"{s}: {name} {sec:.2f}" for s, name, sec in self.entries)


def _changed(fn, old: dict | None, new: dict | None) -> str:
    """The kernel arguments whose specialization differs between two compiles of ``fn``:
    their constexpr values or their attributes (an integer's divisibility by 16, a pointer's
    alignment), from the ``compile`` record Triton's hooks pass (``constants`` and
    ``configs[0]``, keyed by argument paths); ``"?"`` where the records say not."""
    try:
        params = fn.jit_function.params
        seen = []
        for part in ("constants", "configs"):
            a, b = old[part], new[part]
            if part == "configs":
                a, b = a[0], b[0]
            for path in sorted(set(a) | set(b)):
                if a.get(path) != b.get(path):
                    seen.append(path[0])
        return " ".join(params[i].name for i in sorted(set(seen)))
    except (AttributeError, IndexError, KeyError, TypeError):
        return "?"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run(name: str, model, batch: int, context: int, steps: int,
        device: torch.device, cache_capacity: float | None = None) -> tuple[dict, str]:
    """Step times of cache ``name`` (a row) and the profile of its steps after the first
    :data:`WARMUP` (``cache_capacity``: ``wave-pinned``'s block caches)."""
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device,
                        generator=gen)
    cache = make_cache(name, model, batch, context + steps + 1, cache_capacity=cache_capacity)
    hit_rate = None
    try:
        step = make_step(name, model, cache)
        nxt = prefill(model, cache, ids, max(1, 16384 // batch)).argmax(-1)
        times, prof, log = [], cProfile.Profile(), CompileLog()
        with log.hooks():
            for i in range(steps):
                log.at(i)
                _sync(device)
                t0 = time.perf_counter()
                if i >= WARMUP:
                    prof.enable()
                nxt = step(nxt)
                _sync(device)
                if i >= WARMUP:
                    prof.disable()
                times.append(time.perf_counter() - t0)
        hit_rate = block_cache_hit_rate(name, cache)
    finally:
        cache.close()
    median = sorted(times)[len(times) // 2]
    slow = sorted(sorted(range(steps), key=lambda i: -times[i])[:SLOWEST])
    row = {"cache": name, "median_ms": median * 1e3,
           "slowest": ", ".join(f"{i}: {times[i] * 1e3:.0f}" for i in slow),
           "excess_s": sum(t - median for t in times[WARMUP:]),
           "compiled": log.summary(), "steps": steps, "step_ms": times}
    if hit_rate is not None:
        row["hit_rate"] = hit_rate
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    return row, text.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2200)
    parser.add_argument("--caches", nargs="+", default=["wave", "wave-pinned"],
                        choices=["wave", "wave-pinned"])
    parser.add_argument("--cache-capacity", type=float, default=None,
                        help="wave-pinned's block caches (cache.capacity; default: the "
                             "config's)")
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.cache_capacity is not None and not 0 < args.cache_capacity <= 1:
        parser.error("--cache-capacity: must be in (0, 1]")
    device = torch.device(args.device)
    model = build_model(args.layers, args.shape, args.device)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.caches:
        row, profile = run(name, model, args.batch, args.context, args.steps, device,
                           args.cache_capacity)
        (args.out / f"flush_steps_profile_{name}.txt").write_text(profile)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "step_ms"}, flush=True)
    meta = {**machine(), "layers": args.layers, "batch": args.batch, "context": args.context,
            "shape": args.shape, "warmup": WARMUP, "cache_capacity": args.cache_capacity,
            "timing": "each step's wall time between synchronisations (ms)"}
    write_results(args.out, "flush_steps", meta, rows,
                  ["cache", "median_ms", "excess_s", "hit_rate", "slowest", "compiled"],
                  f"Decode steps across segment flushes, {args.layers} layers x {args.batch} x "
                  f"{args.context} tokens, {args.steps} steps (slowest: step: ms; "
                  "compiled: step: Triton kernel, seconds)")


if __name__ == "__main__":
    main()
