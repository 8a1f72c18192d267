"""Where a decode step's time goes: its device time against its wall time, and profiles.

:func:`profile_steps` runs a few decode steps under ``torch.profiler`` and returns the
time the device was busy per step -- the union of the intervals of its kernels, copies and
memsets over all streams, so work on side streams that overlaps is counted once. A step
whose wall time is well above this is host-bound: the device waits for the host to launch
work. With ``path`` it also writes the busiest kernels and host calls and, from a second
run of the same steps under ``cProfile``, the Python functions that spent the host's time.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

__all__ = ["busy_ms", "profile_prefill", "profile_steps", "PROFILE_STEPS"]

PROFILE_STEPS = 8
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def busy_ms(trace_events: list[dict]) -> float:
    """Milliseconds covered by the device events (categories ``kernel``, ``gpu_memcpy``,
    ``gpu_memset``) of a Chrome trace's ``traceEvents``: the union of their ``[ts, ts +
    dur)`` intervals (microseconds), overlaps counted once."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in trace_events
                   if e.get("cat") in DEVICE_CATEGORIES and "ts" in e)
    total, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total / 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def profile_prefill(device: torch.device, path: Path | None) -> Iterator[list[float]]:
    """With ``path`` on a CUDA device, profile the device's work inside the block: the list
    yielded then holds the seconds the device was busy (:func:`busy_ms`), and the busiest
    kernels go to ``path`` with ``_prefill`` before its suffix. Otherwise it stays empty
    and nothing is profiled. The block should end with the device synchronised."""
    busy: list[float] = []
    if path is None or device.type != "cuda":
        yield busy
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield busy
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        busy.append(busy_ms(json.loads(trace.read_text())["traceEvents"]) / 1e3)
    out = path.with_name(f"{path.stem}_prefill{path.suffix}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"prefill: device busy {busy[0]:.2f} s\n\n" + prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=40))


def profile_steps(step: Callable[[torch.Tensor], torch.Tensor], nxt: torch.Tensor,
                  device: torch.device, path: Path | None = None,
                  ) -> tuple[torch.Tensor, float | None]:
    """Run :data:`PROFILE_STEPS` decode steps (``nxt = step(nxt)``) under the profiler.

    Returns the last token ids and the device's busy milliseconds per step (``None``
    without a CUDA device). With ``path``, writes the profile tables there (creating its
    folder) after a second run of the steps under ``cProfile``.
    """
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(PROFILE_STEPS):
            nxt = step(nxt)
        _sync(device)
    gpu_ms = None
    if device.type == "cuda":
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            gpu_ms = busy_ms(json.loads(trace.read_text())["traceEvents"]) / PROFILE_STEPS
    if path is None:
        return nxt, gpu_ms
    py = cProfile.Profile()
    t0 = time.perf_counter()
    py.enable()
    for _ in range(PROFILE_STEPS):
        nxt = step(nxt)
    _sync(device)
    py.disable()
    wall = (time.perf_counter() - t0) / PROFILE_STEPS
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("cumulative").print_stats(45)
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = f"; device busy {gpu_ms:.2f} ms/step" if gpu_ms is not None else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"{PROFILE_STEPS} decode steps; under cProfile {wall * 1e3:.2f} ms/step{busy}\n\n"
        "## device time\n" + events.table(sort_by=sort, row_limit=30)
        + "\n## host time\n" + events.table(sort_by="self_cpu_time_total", row_limit=30)
        + "\n## Python (cProfile, cumulative)\n" + text.getvalue())
    return nxt, gpu_ms
