"""benchmarks/cpu_decode.py: a smoke run writes its rows, and its full-attention
baselines compute exact attention."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from benchmarks import cpu_decode
from tests.reference import exact_attention, rel_err


def test_smoke_run_writes_a_row_per_size(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cpu_decode.py", "--sizes", "smollm2:1x2048",
                                      "smollm2:2x2048", "--reps", "2", "--out", str(tmp_path)])
    cpu_decode.main()
    rows = json.loads((tmp_path / "cpu_decode.json").read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 2048), (2, 2048)]
    for r in rows:
        assert r["executor"] == "NumbaExecutor"  # the default configuration on the CPU
        assert r["full_ms"] == min(r["sdpa_ms"], r["grouped_ms"])
        assert r["speedup_vs_full"] == pytest.approx(r["full_ms"] / r["store_query_ms"])
        assert 0 < r["exact_fraction"] < 1
    assert (tmp_path / "cpu_decode.md").exists()


def test_grouped_attention_is_exact_attention():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 1, 16, generator=gen)
    keys, values = torch.randn(2, 2, 3, 50, 16, generator=gen)
    got = cpu_decode._grouped_attention(q, keys, values, 0.25)
    for b in range(2):
        want, _ = exact_attention(q[b], keys[b], values[b], 0.25)
        assert rel_err(got[b], want) < 1e-5
    sdpa = F.scaled_dot_product_attention(q, keys, values, scale=0.25, enable_gqa=True)
    assert rel_err(got, sdpa) < 1e-5
