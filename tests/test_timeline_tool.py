"""The timeline tool's trace parsing (benchmarks/timeline.py), on a synthetic trace."""

from __future__ import annotations

from benchmarks import timeline


def _kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
            "args": {"stream": stream}}


def test_steps_are_the_kernels_between_two_sleeps():
    trace = {"traceEvents": [
        _kernel("flush", -90, 80), _kernel("spin_kernel", 0, 50), _kernel("a", 60, 10),
        _kernel("b", 65, 10, stream=9), {"cat": "cpu_op", "name": "x", "ts": 70, "dur": 1},
        _kernel("c", 80, 5), _kernel("spin_kernel", 100, 1), _kernel("flush", 120, 80),
        _kernel("spin_kernel", 300, 50), _kernel("d", 355, 4), _kernel("spin_kernel", 400, 1),
    ]}
    steps = timeline.kernel_steps(trace)
    assert [[k["name"] for k in s] for s in steps] == [["a", "b", "c"], ["d"]]
    assert [(k["start"], k["end"], k["stream"]) for k in steps[0]] == [
        (0, 10, 7), (5, 15, 9), (20, 25, 7)]


def test_summary_counts_idle_time_and_busy_time_per_stream():
    step = [{"name": "a", "stream": 7, "start": 0, "end": 10},
            {"name": "b", "stream": 9, "start": 5, "end": 15},
            {"name": "c", "stream": 7, "start": 20, "end": 25}]
    assert timeline.summarize(step) == {"span_us": 25, "busy_us": {"7": 15, "9": 10},
                                        "idle_us": 5, "kernels": 3}
