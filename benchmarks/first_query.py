"""The first batched query after a batch's prompt, through the store: what it builds once.

``--batch`` sequences of ``--context`` tokens (``--heads`` KV heads of ``--dim``; bfloat16 on
CUDA, float32 on a CPU) in ``--layers`` layers of a store of ``--kvstore`` kind, ingested as
a prompt's prefill ingests them (``append_batch`` of ``--chunk`` tokens a row with
``whole_segments``, then ``seal``), then queried as a batch twice, after one short run
that is not recorded (what a process's first query compiles or loads). The first query stacks
the batch's index views (:class:`vecstore.engine.batch.BatchViews`); it is timed alone,
then the second. Two ways of placing the rows:

- ``together``: every row's chunks appended as one batch (what ``StoreAttention`` does), so
  the batch's first placement is one stack of the tier and the first query views it
  (:func:`vecstore.engine.batch_build.stacked_first_rows`);
- ``apart``: each row's chunks appended and sealed on its own, so the first query copies
  every row into a stack of its own (and, in a tier that shares rows, frees the rows' own
  copies).

``peak_gb`` is the tier's peak charge over the run: the KV once, or, where the first query
copied it, up to twice.

    python benchmarks/first_query.py [--batch 4] [--context 32768] [--layers 2]
        [--heads 8] [--dim 128] [--chunk 1024] [--kvstore pinned] [--index wave]
        [--device cuda] [--out DIR]

Writes ``first_query.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine, print_row, write_results  # noqa: E402
from vecstore import Store  # noqa: E402

PLACEMENTS = ("together", "apart")
COLUMNS = ["placement", "batch", "context", "layers", "kvstore", "append_s", "seal_s",
           "first_query_s", "second_query_s", "peak_gb"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(placement: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Ingest the batch's prompt placed ``placement``, then time two batched queries."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, H, D = args.batch, args.heads, args.dim
    config = {"kvstore": {"kind": args.kvstore}, "index": {"kind": args.index},
              "executor": {"device": str(device)}}
    gen = torch.Generator(device=device).manual_seed(0)
    row: dict = {"placement": placement, "batch": B, "context": args.context,
                 "layers": args.layers, "kvstore": args.kvstore}
    with Store.open(config=config) as store:
        seqs = [store.create(f"s{b}", num_layers=args.layers, num_kv_heads=H, head_dim=D,
                             dtype=dtype, device=str(device)) for b in range(B)]
        elapsed = 0.0
        for start in range(0, args.context, args.chunk):
            n = min(args.chunk, args.context - start)
            k = torch.randn(B, H, n, D, generator=gen, device=device, dtype=dtype)
            v = torch.randn(B, H, n, D, generator=gen, device=device, dtype=dtype)
            _sync(device)
            t0 = time.perf_counter()
            for layer in range(args.layers):
                if placement == "together":
                    store.append_batch(seqs, layer, k, v, whole_segments=True)
                else:
                    for b, seq in enumerate(seqs):
                        seq.append(layer, k[b], v[b], whole_segments=True)
            _sync(device)
            elapsed += time.perf_counter() - t0
        row["append_s"] = elapsed
        t0 = time.perf_counter()
        for layer in range(args.layers):
            for part in ([seqs] if placement == "together" else [[seq] for seq in seqs]):
                store.seal(part, layer)
        _sync(device)
        row["seal_s"] = time.perf_counter() - t0
        q = torch.randn(B, 4 * H, 1, D, generator=gen, device=device, dtype=dtype)
        for name in ("first_query_s", "second_query_s"):
            t0 = time.perf_counter()
            for layer in range(args.layers):
                store.query(seqs, layer, q)
            _sync(device)
            row[name] = time.perf_counter() - t0
        # the tier's account: its rows (the index metadata is charged to the device's)
        tier = store.placement.tier(seqs[0].layers[0].device)
        row["peak_gb"] = tier.account.peak_bytes / 1e9
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens a row per append")
    parser.add_argument("--kvstore", choices=["pinned", "memory"], default="pinned")
    parser.add_argument("--index", default="wave", help="index.kind")
    parser.add_argument("--placements", nargs="+", choices=PLACEMENTS,
                        default=list(PLACEMENTS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if min(args.batch, args.context, args.layers, args.heads, args.dim, args.chunk) < 1:
        parser.error("--batch, --context, --layers, --heads, --dim and --chunk must be "
                     "at least 1")
    if args.batch < 2:
        parser.error("--batch: a batch needs at least 2 sequences")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    # one untimed run first, of the same shapes: the kernels a query compiles for them
    # (Triton specializes on the cluster count's blocks) are compiled once per process, and
    # would otherwise be charged to whichever placement runs first
    run(args.placements[0], args, device)
    rows = []
    for placement in args.placements:
        rows.append(run(placement, args, device))
        print_row(rows[-1])
    meta = {**machine(), **{k: str(v) if isinstance(v, Path) else v
                            for k, v in vars(args).items()}}
    write_results(args.out, "first_query", meta, rows, COLUMNS,
                  "First batched query after a batch's prompt")


if __name__ == "__main__":
    main()
