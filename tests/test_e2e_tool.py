"""benchmarks/e2e.py's summary of the largest batch each cache ran."""

from __future__ import annotations

import pytest

from benchmarks.e2e import largest


def test_largest_batch_each_and_the_ratio_between_them():
    rows = [
        {"batch": 24, "sdpa_tokens_per_s": 337.0, "wave_tokens_per_s": 2598.0},
        {"batch": 32, "sdpa_tokens_per_s": 343.0, "wave_error": "oom"},
        {"batch": 36, "wave_tokens_per_s": 3702.0, "sdpa_error": "oom"},
        {"batch": 8, "static_tokens_per_s": 81.0, "sdpa_tokens_per_s": 112.0},
        {"batch": 40, "wave_error": "RuntimeError: boom"},
    ]
    top = largest(rows)
    assert top["sdpa"] == {"batch": 32, "tokens_per_s": 343.0, "oom_at": 36}
    assert top["wave"] == {"batch": 36, "tokens_per_s": 3702.0, "oom_at": 32}
    assert top["static"] == {"batch": 8, "tokens_per_s": 81.0, "oom_at": None}
    assert top["speedup"] == pytest.approx(3702.0 / 343.0)


def test_no_ratio_without_both_sides():
    assert "speedup" not in largest([{"batch": 4, "wave_tokens_per_s": 10.0}])
    assert largest([{"batch": 4, "sdpa_error": "oom"}]) == {}


def test_kv_bytes_read_per_step():
    from types import SimpleNamespace

    from benchmarks.e2e import kv_read_gb

    cfg = SimpleNamespace(num_key_value_heads=8, head_dim=128, num_hidden_layers=4)
    full = 4 * 8 * 131072 * (2 * 8 * 128 * 2) / 1e9  # layers x batch x tokens x K+V bf16
    assert kv_read_gb(cfg, "sdpa", 8, 131072, {}) == pytest.approx(full)
    assert kv_read_gb(cfg, "static", 8, 131072, {}) == pytest.approx(full)
    assert kv_read_gb(cfg, "wave", 8, 131072, {"exact_fraction": 0.02}) == pytest.approx(
        0.02 * full)
