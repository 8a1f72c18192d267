"""benchmarks/prefill.py: a CPU smoke run writes a row per variant and store kind."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import prefill


def test_cpu_smoke_run_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [
        "prefill.py", "--device", "cpu", "--layers", "2", "--batch", "2", "--context", "96",
        "--chunk", "40", "--heads", "4", "2", "16", "--out", str(tmp_path)])
    prefill.main()
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    assert [(r["variant"], r["kvstore"]) for r in rows] == [
        ("full", "-"), *((v, k) for v in prefill.VARIANTS[1:] for k in ("memory", "pinned"))]
    full = rows[0]["seconds"]
    assert all(r["seconds"] > 0 and r["over_full"] == pytest.approx(r["seconds"] / full)
               for r in rows)
    assert (tmp_path / "prefill.md").exists()


def test_full_attention_baseline_computes_what_the_store_does():
    import torch

    from attention import StoreAttention
    from vecstore import Store

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 90, 8, generator=gen) for h in (4, 2, 2))
    kv = [(torch.empty(2, 2, 90, 8), torch.empty(2, 2, 90, 8))]
    with Store.open() as store:
        seqs = [store.create(f"r{b}", num_layers=1, num_kv_heads=2, head_dim=8,
                             dtype=torch.float32) for b in range(2)]
        attn = StoreAttention(store, seqs)
        for s in range(0, 90, 30):
            part = slice(s, s + 30)
            full = prefill.full_step(kv, s)(0, q[:, :, part], k[:, :, part], v[:, :, part])
            ours = attn(0, q[:, :, part], k[:, :, part], v[:, :, part])
            torch.testing.assert_close(full, ours, atol=1e-5, rtol=1e-5)
