"""benchmarks/host_pages.py: a CPU smoke run writes a row per method and mapping, and leaves
the tier's faulting settings as they were."""

from __future__ import annotations

import json
import mmap
import sys

from benchmarks import host_pages as tool
from vecstore.kvstore import host_pages


def test_cpu_smoke_run_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(host_pages, "_FAULT_THREADS", host_pages._FAULT_THREADS)
    monkeypatch.setattr(host_pages, "_MAP_FLAGS", host_pages._MAP_FLAGS)
    monkeypatch.setattr(sys, "argv", ["host_pages.py", "--gib", str(64 * mmap.PAGESIZE / 2**30),
                                      "--threads", "2", "--out", str(tmp_path)])
    tool.main()
    rows = json.loads((tmp_path / "host_pages.json").read_text())["rows"]
    populate = ["populate", "populate_t2"] if host_pages._madvise() is not None else []
    assert [(r["method"], r["mapping"]) for r in rows] == [
        (m, k) for k in ("private", "shared") for m in ("register", *populate, "zero_t2")]
    assert all(r["total_s"] >= r["fault_s"] >= 0 and r["register_s"] >= 0 for r in rows)
    assert (tmp_path / "host_pages.md").exists()
