"""Persistence costs on CPU: disk size, reopen and first-query time, write overheads.

Builds an on-disk store holding one sequence of ``--tokens`` tokens x ``--layers`` layers in
SmolLM2-135M's KV shape (3 KV heads, head_dim 64, 9 query heads, bfloat16) with the default
config, then measures, in one process:

- store size on disk against the raw KV size;
- per-layer prefill: the share spent persisting (files + catalog commit) vs indexing;
- decode appends (1 token x all layers), interleaved blocks: in-memory store, on-disk
  with one commit per append, on-disk with one ``store.transaction()`` per step;
- reopen with the store's files evicted from the page cache (``posix_fadvise``):
  open time, first query (loads and checksums layer 0), first full decode step (every
  layer's first query), then the same step warm; against re-indexing from raw KV;
- ``verify`` of the whole store, cold.

Writes ``benchmarks/results/persistence.{json,md}``.

    python benchmarks/persistence.py [--tokens 131072] [--layers 30] [--path DIR [--reuse]]

With ``--path DIR --reuse`` a store built there by an earlier run (``DIR/store`` with
``DIR/build.json`` and ``DIR/reference.safetensors``) is measured again without rebuilding.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import safetensors
import sqlalchemy
import torch
from safetensors.torch import load_file, save_file

from vecstore import Store
from vecstore.catalog.catalog import Catalog
from vecstore.storage.persistence import Persistence

RESULTS = Path(__file__).parent / "results"
KV_HEADS, Q_HEADS, DIM, DTYPE = 3, 9, 64, torch.bfloat16


def kv(layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-structured keys (like real ones) and Gaussian values, ``[3, T, 64]``."""
    gen = torch.Generator().manual_seed(layer)
    centers = 2.0 * torch.randn(KV_HEADS, max(1, tokens // 64), DIM, generator=gen)
    pick = torch.randint(0, centers.shape[1], (KV_HEADS, tokens), generator=gen)
    keys = torch.gather(centers, 1, pick[..., None].expand(-1, -1, DIM))
    keys = keys + 0.5 * torch.randn(KV_HEADS, tokens, DIM, generator=gen)
    return keys.to(DTYPE), torch.randn(KV_HEADS, tokens, DIM, generator=gen).to(DTYPE)


def evict(path: Path) -> None:
    """Drop the store's files from the page cache (clean pages only; no privileges)."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(Path(d) / f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_ms(where: Path, repeats: int = 50) -> float:
    """Median latency of appending 1 KiB to a file and fsync-ing it: the floor of a
    commit on this disk at this moment (it swings with other processes' I/O)."""
    probe = where / "fsync-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    times = []
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            os.write(fd, b"x" * 1024)
            os.fsync(fd)
            times.append((time.perf_counter() - t) * 1e3)
    finally:
        os.close(fd)
        probe.unlink()
    return statistics.median(times)


def timed(fn, *args):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def build(path: Path, tokens: int, layers: int) -> dict:
    commit_s: list[float] = []
    real_commit = Persistence.commit

    def commit(self, changes, config):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        real_commit(self, changes, config)
        commit_s.append(time.perf_counter() - t)

    Persistence.commit = commit  # type: ignore[method-assign]
    per_layer = []
    try:
        with Store.open(path) as store:
            seq = store.create("doc", num_layers=layers, num_kv_heads=KV_HEADS, head_dim=DIM,
                               dtype=DTYPE)
            for layer in range(layers):
                k, v = kv(layer, tokens)
                commit_s.clear()
                total, _ = timed(seq.append, layer, k, v)
                per_layer.append((total, sum(commit_s)))
                print(f"layer {layer}: {total:.1f} s ({sum(commit_s):.2f} s persisting)",
                      flush=True)
            q = torch.randn(Q_HEADS, 1, DIM, generator=torch.Generator().manual_seed(99))
            before = seq.query(0, q.to(DTYPE))
    finally:
        Persistence.commit = real_commit  # type: ignore[method-assign]
    total = sum(t for t, _ in per_layer)
    persist = sum(c for _, c in per_layer)
    save_file({"out": before.out, "lse": before.lse}, path.parent / "reference.safetensors")
    stats = {"prefill_s": total, "persist_s": persist, "index_s": total - persist,
             "persist_share": persist / total,
             "per_layer_s": statistics.median(t for t, _ in per_layer)}
    (path.parent / "build.json").write_text(json.dumps(stats, indent=2))
    return stats


def decode(path: Path, layers: int, steps: int, block: int = 16) -> dict:
    """ms per decode step (1 token x every layer), interleaved blocks per mode."""
    prefix = 4096
    times: dict[str, list[float]] = {"memory": [], "disk_per_append": [], "disk_transaction": []}
    commits: list[float] = []
    real_commit = Catalog.commit

    def commit(self, plan):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = real_commit(self, plan)
        commits.append((time.perf_counter() - t) * 1e3)
        return out

    Catalog.commit = commit  # type: ignore[method-assign]
    with Store.open() as mem, Store.open(path) as disk:
        seqs = {}
        for name, store in (("memory", mem), ("disk", disk)):
            s = store.create("decode", num_layers=layers, num_kv_heads=KV_HEADS, head_dim=DIM,
                             dtype=DTYPE)
            with store.transaction():
                for layer in range(layers):
                    s.append(layer, *kv(1000 + layer, prefix))
            seqs[name] = (store, s)
        one = [kv(2000 + i, 1) for i in range(block)]
        for _ in range(steps // block):
            for mode in times:
                store, s = seqs["memory" if mode == "memory" else "disk"]
                t = time.perf_counter()
                for k, v in one:
                    if mode == "disk_transaction":
                        with store.transaction():
                            for layer in range(layers):
                                s.append(layer, k, v)
                    else:
                        for layer in range(layers):
                            s.append(layer, k, v)
                times[mode].append((time.perf_counter() - t) / block * 1e3)
        disk.drop("decode")
    Catalog.commit = real_commit  # type: ignore[method-assign]
    out = {f"{m}_ms_per_step": statistics.median(v) for m, v in times.items()}
    out["fsync_ms"] = fsync_ms(path.parent)
    out["catalog_commit_ms_median"] = statistics.median(commits)
    out["catalog_commit_ms_p90"] = sorted(commits)[int(0.9 * len(commits))]
    base = out["memory_ms_per_step"]
    out |= {f"{m}_vs_memory": out[f"{m}_ms_per_step"] / base for m in times if m != "memory"}
    return out


def step(seq, q: torch.Tensor, layers: range) -> None:  # type: ignore[no-untyped-def]
    """One decode step's queries over ``layers``."""
    for layer in layers:
        seq.query(layer, q)


def reopen(path: Path, layers: int, reference: tuple[torch.Tensor, torch.Tensor],
           repeats: int) -> dict:
    q = torch.randn(Q_HEADS, 1, DIM, generator=torch.Generator().manual_seed(99)).to(DTYPE)
    runs = []
    for _ in range(repeats):
        evict(path)
        t_open, store = timed(lambda: Store.open(path, read_only=True))
        with store:
            seq = store.sequence("doc")
            t_first, res = timed(seq.query, 0, q)
            t_second, _ = timed(seq.query, 0, q)
            t_rest, _ = timed(step, seq, q, range(1, layers))
            t_warm, _ = timed(step, seq, q, range(layers))
        del store, seq
        gc.collect()
        runs.append({"open_s": t_open, "first_query_s": t_first, "second_query_s": t_second,
                     "first_step_s": t_first + t_rest, "warm_step_s": t_warm,
                     "bit_for_bit": bool(torch.equal(res.out, reference[0])
                                         and torch.equal(res.lse, reference[1]))})
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "bit_for_bit"}
    out["bit_for_bit"] = all(r["bit_for_bit"] for r in runs)
    out["repeats"] = repeats
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--path", type=Path, default=None,
                        help="where to build the store (a temporary directory by default)")
    parser.add_argument("--reuse", action="store_true",
                        help="measure the store an earlier run built in --path")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp()) if args.path is None else args.path
    path = root / "store"
    try:
        if args.reuse and args.path is not None:
            built = json.loads((root / "build.json").read_text())
        else:
            built = build(path, args.tokens, args.layers)
        ref = load_file(root / "reference.safetensors")
        reference = (ref["out"], ref["lse"])
        dec = decode(path, args.layers, args.decode_steps)
        with Store.open(path) as store:
            store.gc()
            info = store.info()
        files = [Path(d) / f for d, _, fs in os.walk(path) for f in fs]
        data_bytes = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
        size = {"raw_kv_bytes": info.raw_kv_bytes, "disk_bytes": info.disk_bytes,
                "data_file_bytes": data_bytes, "catalog_bytes": info.catalog_bytes,
                "disk_vs_raw": info.disk_bytes / info.raw_kv_bytes,
                "segments": info.sequences[0].num_segments,
                "clusters": info.sequences[0].num_clusters}
        opened = reopen(path, args.layers, reference, args.repeats)
        opened["reindex_s"] = built["index_s"]
        opened["first_step_vs_reindex"] = opened["first_step_s"] / built["index_s"]
        evict(path)
        with Store.open(path, read_only=True) as store:
            t_verify, report = timed(store.verify)
        verify = {"verify_s": t_verify, "bytes_checked": report.bytes_checked,
                  "verify_mb_per_s": report.bytes_checked / t_verify / 1e6}
    finally:
        if args.path is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "sqlalchemy": sqlalchemy.__version__,
                     "safetensors": safetensors.__version__, "sqlite": sqlite3.sqlite_version},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": os.getloadavg(),
        "settings": {"tokens": args.tokens, "layers": args.layers, "kv_heads": KV_HEADS,
                     "q_heads": Q_HEADS, "head_dim": DIM, "dtype": "bfloat16",
                     "config": "defaults", "decode_steps": args.decode_steps},
        "size": size, "prefill": built, "decode": dec, "reopen": opened, "verify": verify,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "persistence.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "persistence.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    s, p, d, o, v = r["size"], r["prefill"], r["decode"], r["reopen"], r["verify"]
    gib = 2.0 ** 30
    t = r["settings"]
    return "\n".join([
        f"# Persistence on CPU ({t['tokens']} tokens x {t['layers']} layers, "
        f"{t['kv_heads']} KV heads x {t['head_dim']}, {t['dtype']})",
        "",
        f"{r['machine']['cpus']} CPUs, torch {r['versions']['torch']}, "
        f"SQLite {r['versions']['sqlite']}, {r['date']}, load average "
        f"{r['load_average'][0]:.1f} (a shared machine: see docs/persistence.md). Produced by "
        "`benchmarks/persistence.py`.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| raw KV | {s['raw_kv_bytes'] / gib:.3f} GiB |",
        f"| store on disk | {s['disk_bytes'] / gib:.3f} GiB ({s['disk_vs_raw']:.3f} x raw) |",
        f"| of which segment files / catalog | {s['data_file_bytes'] / gib:.3f} GiB / "
        f"{s['catalog_bytes'] / 2**20:.1f} MiB |",
        f"| segments / clusters | {s['segments']} / {s['clusters']} |",
        f"| prefill per layer (median) | {p['per_layer_s']:.1f} s, "
        f"{100 * p['persist_share']:.1f}% of it persisting |",
        f"| catalog commit during the decode runs, median / p90 | "
        f"{d['catalog_commit_ms_median']:.1f} / {d['catalog_commit_ms_p90']:.1f} ms (a bare "
        f"fsync after them: {d['fsync_ms']:.2f} ms) |",
        f"| decode step, in memory | {d['memory_ms_per_step']:.1f} ms |",
        f"| decode step, on disk, one commit per append | {d['disk_per_append_ms_per_step']:.1f} "
        f"ms ({d['disk_per_append_vs_memory']:.1f} x memory) |",
        f"| decode step, on disk, one transaction per step | "
        f"{d['disk_transaction_ms_per_step']:.1f} ms ({d['disk_transaction_vs_memory']:.2f} x "
        "memory) |",
        f"| reopen (files evicted from page cache) | {1e3 * o['open_s']:.0f} ms |",
        f"| first query (layer 0: load + checksum + query) | {1e3 * o['first_query_s']:.0f} ms "
        f"(then {1e3 * o['second_query_s']:.0f} ms warm) |",
        f"| first decode step, all layers | {o['first_step_s']:.2f} s (warm step "
        f"{1e3 * o['warm_step_s']:.0f} ms) |",
        f"| re-indexing the raw KV instead | {o['reindex_s']:.0f} s (reopen path is "
        f"{o['first_step_vs_reindex']:.4f} x of it) |",
        f"| reopened answers bit-for-bit equal | {o['bit_for_bit']} |",
        f"| verify, cold | {v['verify_s']:.1f} s ({v['verify_mb_per_s']:.0f} MB/s) |",
        "",
    ])


if __name__ == "__main__":
    main()
