"""benchmarks/e2e.py: its arguments, its ratios (always against ``full``), the device's busy
time, its greedy pick, and a whole run on the CPU with a tiny model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.e2e import main, parse_args
from benchmarks.e2e_models import greedy
from benchmarks.e2e_profile import busy_ms, profile_prefill
from benchmarks.e2e_report import kv_read_gb, largest, with_ratios
from benchmarks.flash_varlen import SPLITS_SUPPORTED


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 700), chunk=st.sampled_from([1, 7, 64, 256]),
       levels=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_the_greedy_pick_is_argmax_ties_to_the_first(rows, vocab, chunk, levels, seed):
    # few distinct values: ties within and across chunks, and a padded last chunk
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    assert torch.equal(greedy(logits, chunk), logits.argmax(-1, keepdim=True))


def _row(batch, cache, **kw):
    return {"batch": batch, "context": 131072, "layers": 4, "cache": cache, **kw}


def test_every_ratio_divides_by_full_at_the_same_batch():
    rows = with_ratios([
        _row(8, "full", tokens_per_s=1582.0, prefill_s=10.0, step_ms=5.06, gpu_ms=4.6),
        _row(8, "wave", tokens_per_s=876.0, prefill_s=25.0, step_ms=9.14, gpu_ms=2.3),
        _row(8, "dynamic", tokens_per_s=200.0, prefill_s=20.0, step_ms=40.0),
        _row(24, "wave", tokens_per_s=3315.0, prefill_s=90.0, step_ms=7.24),
        _row(24, "full", tokens_per_s=1699.0, prefill_s=40.0, step_ms=14.1),
        _row(24, "dynamic", error="oom"),
    ])
    by = {(r["batch"], r["cache"]): r for r in rows}
    assert by[8, "wave"]["vs_full"] == pytest.approx(876.0 / 1582.0)  # not / dynamic's 200
    assert by[8, "dynamic"]["vs_full"] == pytest.approx(200.0 / 1582.0)
    assert by[24, "wave"]["vs_full"] == pytest.approx(3315.0 / 1699.0)
    assert by[8, "full"]["vs_full"] == 1.0
    assert by[8, "wave"]["prefill_vs_full"] == pytest.approx(2.5)
    assert by[8, "wave"]["wall_over_gpu"] == pytest.approx(9.14 / 2.3)
    assert "wall_over_gpu" not in by[8, "dynamic"]  # device time unknown
    assert "vs_full" not in by[24, "dynamic"]


def test_pinned_rows_divide_by_the_resident_wave_row_of_their_batch():
    rows = with_ratios([
        _row(8, "wave", tokens_per_s=4000.0, prefill_s=20.0, step_ms=2.0),
        _row(8, "wave-pinned", tokens_per_s=1400.0, prefill_s=21.0, step_ms=5.7,
             cache_capacity=0.05),
        _row(8, "wave-pinned", tokens_per_s=3000.0, prefill_s=21.0, step_ms=2.7,
             cache_capacity=0.5),
        _row(24, "wave-pinned", tokens_per_s=1600.0, prefill_s=70.0, step_ms=15.0),
    ])
    assert [r.get("vs_resident") for r in rows] == [None, pytest.approx(0.35),
                                                    pytest.approx(0.75), None]


def test_no_ratio_without_full_at_that_batch_and_context():
    rows = with_ratios([_row(8, "full", tokens_per_s=1.0, prefill_s=1.0, step_ms=1.0),
                        {**_row(8, "wave", tokens_per_s=5.0, prefill_s=1.0, step_ms=1.0),
                         "context": 524288},
                        _row(16, "wave", tokens_per_s=5.0, prefill_s=1.0, step_ms=1.0)])
    assert all("vs_full" not in r for r in rows if r["cache"] == "wave")


def test_largest_batch_each_divides_by_full_at_its_largest():
    rows = [
        _row(24, "full", tokens_per_s=1699.0), _row(56, "full", tokens_per_s=1800.0),
        _row(64, "full", error="oom"),
        _row(24, "wave", tokens_per_s=3315.0), _row(36, "wave", tokens_per_s=3702.0),
        _row(40, "wave", error="oom"),
        _row(32, "dynamic", tokens_per_s=343.0), _row(36, "dynamic", error="RuntimeError: x"),
    ]
    top = largest(rows)
    assert top["full"] == {"batch": 56, "tokens_per_s": 1800.0, "oom_at": 64}
    assert top["wave"]["batch"] == 36 and top["wave"]["oom_at"] == 40
    assert top["wave"]["vs_full"] == pytest.approx(3702.0 / 1800.0)
    assert top["dynamic"]["vs_full"] == pytest.approx(343.0 / 1800.0)
    assert top["dynamic"]["oom_at"] is None
    assert "vs_full" not in largest([_row(4, "wave", tokens_per_s=10.0)])["wave"]
    assert largest([_row(4, "full", error="oom")]) == {}


def test_kv_bytes_read_per_step():
    cfg = SimpleNamespace(num_key_value_heads=8, head_dim=128, num_hidden_layers=4)
    whole = 4 * 8 * 131072 * (2 * 8 * 128 * 2) / 1e9  # layers x batch x tokens x K+V bf16
    for name in ("full", "dynamic", "static"):
        assert kv_read_gb(cfg, name, 8, 131072, {}) == pytest.approx(whole)
    for name in ("wave", "wave-pinned"):
        assert kv_read_gb(cfg, name, 8, 131072, {"exact_fraction": 0.02}) == pytest.approx(
            0.02 * whole)


def test_device_busy_time_is_the_union_of_device_intervals():
    events = [
        {"cat": "kernel", "ts": 0.0, "dur": 100.0},
        {"cat": "kernel", "ts": 50.0, "dur": 100.0},  # overlaps the first (a side stream)
        {"cat": "gpu_memcpy", "ts": 300.0, "dur": 50.0},
        {"cat": "gpu_memset", "ts": 320.0, "dur": 10.0},  # inside the copy
        {"cat": "cuda_runtime", "ts": 0.0, "dur": 1000.0},  # host side: not counted
        {"cat": "kernel", "ts": 400.0, "dur": 0.0},
        {"ph": "M", "name": "process_name"},
    ]
    assert busy_ms(events) == pytest.approx((150.0 + 50.0) / 1e3)
    assert busy_ms([]) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_prefill_profile_counts_the_device_busy_time(tmp_path):
    path = tmp_path / "profiles" / "e2e_profile_wave_b2.txt"
    x = torch.randn(4096, 4096, device="cuda")
    with profile_prefill(torch.device("cuda"), path) as busy:
        for _ in range(20):
            x = x @ x.T / 64
        torch.cuda.synchronize()
    assert busy and busy[0] > 0
    assert "prefill: device busy" in path.with_name("e2e_profile_wave_b2_prefill.txt").read_text()


def test_arguments():
    args = parse_args([])
    assert args.caches == ["full", "wave", "wave-pinned", "dynamic"]
    assert (args.layers, args.context, args.batches) == (4, 131072, [1, 8])
    assert args.full_splits == [0, 2, 4, 8] and not args.profile_prefill and args.fuse_qkv
    assert not parse_args(["--separate-qkv"]).fuse_qkv
    args = parse_args(["--layers", "32", "--batches", "1", "2", "3", "4", "--caches", "full",
                       "wave", "wave-pinned", "--steps", "64"])
    assert args.layers == 32 and args.batches == [1, 2, 3, 4] and args.steps == 64
    assert args.caches == ["full", "wave", "wave-pinned"]


@pytest.mark.parametrize("argv, message", [
    (["--batches", "0"], "--batches: each must be between 1 and 64"),
    (["--batches", "65"], "--batches: each must be between 1 and 64"),
    (["--caches", "full", "sdpa"], "invalid choice: 'sdpa'"),
    (["--caches", "full", "full"], "--caches: name each cache once"),
    (["--layers", "0"], "must be at least 1"),
    (["--full-splits", "0", "129"], "--full-splits: each must be between 0 and 128"),
    (["--cache-capacities", "0.05", "0"], "--cache-capacities: each must be in (0, 1]"),
    (["--cache-capacities", "1.5"], "--cache-capacities: each must be in (0, 1]"),
])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_whole_run_on_the_cpu_writes_results_and_profiles_to_a_new_folder(tmp_path):
    out = tmp_path / "not" / "yet"  # --profile used to write here before creating it
    main(["--device", "cpu", "--model", "tiny", "--layers", "2", "--context", "24",
          "--batches", "2", "--steps", "2", "--caches", "full", "wave", "dynamic",
          "--full-splits", "0", "4", "--profile", "--profile-prefill", "--separate-qkv",
          "--out", str(out)])
    result = json.loads((out / "e2e.json").read_text())
    assert result["meta"]["fuse_qkv"] is False
    rows = {r["cache"]: r for r in result["rows"]}
    assert set(rows) == {"full", "wave", "dynamic"} and not any("error" in r for r in
                                                                rows.values())
    for name in ("wave", "dynamic"):
        assert rows[name]["vs_full"] == pytest.approx(rows[name]["tokens_per_s"]
                                                      / rows["full"]["tokens_per_s"])
    assert result["meta"]["largest"]["wave"]["batch"] == 2
    by_splits = rows["full"]["step_ms_by_splits"]  # the fastest variant is full's row
    splits = [0, 4] if SPLITS_SUPPORTED else [0]
    assert set(by_splits) == {str(n) for n in splits}
    assert rows["full"]["step_ms"] == pytest.approx(min(by_splits.values()))
    assert by_splits[str(rows["full"]["num_splits"])] == pytest.approx(rows["full"]["step_ms"])
    # KV bytes over the timed steps' mean length: 24 prompt + the first step (timed alone)
    # + 4 warm-up + 2 / 2, after the 4 + 2 steps of each variant timed before
    turn = splits.index(rows["full"]["num_splits"])
    assert rows["full"]["mean_tokens"] == 30 + 6 * turn
    assert rows["wave"]["mean_tokens"] == rows["dynamic"]["mean_tokens"] == 30
    assert all(r["first_step_s"] > 0 for r in rows.values())
    for name in rows:
        assert "decode steps" in (out / "e2e_profiles" / f"e2e_profile_{name}_b2.txt").read_text()
        # the prefill's device time is a CUDA profile's: none on the CPU
        assert "prefill_gpu_s" not in rows[name]
        assert not (out / "e2e_profiles" / f"e2e_profile_{name}_b2_prefill.txt").exists()
    assert "transformers' defaults" in (out / "e2e.md").read_text()
    assert (out / "e2e.png").exists()


def test_compiled_layers_and_fused_projections_run_for_full_and_wave_alike(tmp_path):
    main(["--device", "cpu", "--model", "tiny", "--layers", "2", "--context", "24",
          "--batches", "2", "--steps", "2", "--caches", "full", "wave", "--full-splits", "0",
          "--compile-layers", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert result["meta"]["compile_layers"] is True and result["meta"]["fuse_qkv"] is True
    assert not any("error" in r for r in result["rows"]) and len(result["rows"]) == 2


def test_pinned_runs_once_per_block_cache_capacity(tmp_path):
    main(["--device", "cpu", "--model", "tiny", "--layers", "2", "--context", "24",
          "--batches", "2", "--steps", "2", "--caches", "wave", "wave-pinned",
          "--cache-capacities", "0.05", "0.5", "--profile", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [(r["cache"], r.get("cache_capacity")) for r in rows] == [
        ("wave", None), ("wave-pinned", 0.05), ("wave-pinned", 0.5)]
    assert not any("error" in r for r in rows)
    for r in rows[1:]:
        assert r["vs_resident"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])
        name = f"e2e_profile_wave-pinned_c{r['cache_capacity']:g}_b2.txt"
        assert (tmp_path / "e2e_profiles" / name).exists()
