"""benchmarks/index_build.py: its byte count, and a CPU smoke run of the whole script."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import index_build


def test_keys_read_per_build():
    # 10 iterations over 8 KV heads x 131072 tokens x 128 dims of bf16
    assert index_build.keys_read_gb(131072, 10) == pytest.approx(10 * 8 * 131072 * 128 * 2 / 1e9)


def test_cpu_smoke_run_writes_every_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["index_build.py", "--device", "cpu", "--contexts", "8192",
                                      "--out", str(tmp_path)])
    index_build.main()
    (row,) = json.loads((tmp_path / "index_build.json").read_text())["rows"]
    assert row["context"] == 8192 and row["build_torch_s"] > 0
    assert row["build_torch_gbs"] == pytest.approx(
        index_build.keys_read_gb(8192, 10) / row["build_torch_s"])
    assert (tmp_path / "index_build.md").exists() and (tmp_path / "index_build.png").exists()
