"""benchmarks/flush_steps.py: a whole run on the CPU with a tiny model, across flushes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.flush_steps import WARMUP, CompileLog, main


def test_flush_steps_times_every_step_and_profiles_the_host(tmp_path):
    main(["--shape", "tiny", "--device", "cpu", "--layers", "2", "--batch", "2",
          "--context", "64", "--steps", "1040", "--caches", "wave", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "flush_steps.json").read_text())["rows"]
    (row,) = rows
    assert row["cache"] == "wave" and len(row["step_ms"]) == 1040
    assert row["median_ms"] > 0 and len(row["slowest"].split(", ")) == 8
    profile = (tmp_path / "flush_steps_profile_wave.txt").read_text()
    assert "function calls" in profile and "append" in profile  # a flush's append ran
    assert WARMUP < 1040
    assert "| wave |" in (tmp_path / "flush_steps.md").read_text()
    assert row["compiled"] == ""  # the CPU's torch fallbacks compile no Triton kernel


def test_a_capacity_outside_its_range_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--cache-capacity", "0", "--device", "cpu"])
    assert "--cache-capacity: must be in (0, 1]" in capsys.readouterr().err


def test_compile_log_pairs_triton_hooks_by_step_and_restores_them():
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    log = CompileLog()
    with log.hooks():
        rt = knobs.runtime
        log.at(3)
        assert rt.jit_cache_hook(key=("a",), fn=SimpleNamespace(name="_k1")) is False
        log.at(7)  # the compile of _k1 ends at the step it ends in; _k2 starts and ends there
        rt.jit_post_compile_hook(key=("a",), fn=SimpleNamespace(name="_k1"))
        rt.jit_cache_hook(key=("b",), fn=SimpleNamespace(name="_k2"))
        rt.jit_post_compile_hook(key=("b",), fn=SimpleNamespace(name="_k2"))
        rt.jit_post_compile_hook(key=("c",), fn=SimpleNamespace(name="_never_started"))
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    assert [(s, name) for s, name, _ in log.entries] == [(7, "_k1"), (7, "_k2")]
    assert log.summary().startswith("7: _k1 0.00, 7: _k2 ")


def test_compile_log_names_the_arguments_a_second_compile_specialized_differently():
    pytest.importorskip("triton")
    params = [SimpleNamespace(name=n) for n in ("x_ptr", "n", "m", "BLOCK")]
    fn = SimpleNamespace(name="_k", jit_function=SimpleNamespace(params=params))
    records = [{"constants": {(3,): 64}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                      (1,): [["tt.divisibility", 16]]}]},
               {"constants": {(3,): 128}, "configs": [{(0,): [["tt.divisibility", 16]]}]},
               {"constants": {(3,): 128}, "configs": [{(0,): [["tt.divisibility", 16]]}]}]
    log = CompileLog()
    from triton import knobs
    with log.hooks():
        for step, record in enumerate(records):
            log.at(step)
            knobs.runtime.jit_cache_hook(key=f"k{step}", fn=fn, compile=record)
            knobs.runtime.jit_post_compile_hook(key=f"k{step}", fn=fn, compile=record)
        knobs.runtime.jit_cache_hook(key="odd", fn=fn)  # a record of another shape
        knobs.runtime.jit_post_compile_hook(key="odd", fn=fn, compile={"other": 1})
    assert [name for _, name, _ in log.entries] == ["_k", "_k (n BLOCK)", "_k", "_k (?)"]
