"""benchmarks/flush_steps.py: a whole run on the CPU with a tiny model, across flushes."""

from __future__ import annotations

import json

from benchmarks.flush_steps import WARMUP, main


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
