"""The user's path against the kernels: ``Store.query`` (default configuration, one layer of
the Llama-3-8B attention shape) side by side with the same step captured privately, as
``decode.py`` times it, and with SDPA over the same keys and values, all in one process.

Each figure is the wall time per call of a loop of calls (what a decode loop sees: host
work included, as a user's program waits on it), queries drifting between calls so the
block cache of pinned rows sees a realistic hit rate.

    python benchmarks/store_query.py --sizes 1x131072 8x131072 --pinned 8x131072
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import machine, print_row, write_results
from benchmarks.decode_setup import HKV, HQ, SCALE, capture, drift, make_inputs
from vecstore import Store

RESULTS = Path(__file__).parent / "results"


def _loop(fn, queries: list[torch.Tensor], reps: int) -> float:
    """Median over 5 rounds of the wall milliseconds per call of ``reps`` calls."""
    for q in queries[:3]:
        fn(q)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(reps):
            fn(queries[i % len(queries)])
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) * 1e3 / reps)
    return sorted(rounds)[2]


def run(batch: int, tokens: int, kind: str, reps: int) -> dict:
    dev = torch.device("cuda")
    view, _, q = make_inputs(batch, tokens, dev, seed=batch + tokens % 101)
    gen = torch.Generator(device=dev).manual_seed(3)
    queries = [q]
    for _ in range(15):
        queries.append(drift(queries[-1], gen, 0.9))
    config = {"executor": {"device": "cuda"}, "kvstore": {"kind": kind}}
    with Store.open(config=config) as store:
        seqs = []
        for b in range(batch):
            seq = store.create(f"s{b}", num_layers=1, num_kv_heads=HKV,
                               head_dim=view.keys.shape[-1], dtype=torch.bfloat16)
            seq.append(0, view.keys[b], view.values[b])  # builds the wave index
            seqs.append(seq)
        executor = store.executor
        queries4 = [x[:, :, None] for x in queries]
        user = _loop(lambda x: store.query(seqs, 0, x), queries4, reps)
        # the same step, captured as decode.py captures it: the stacked view and steady zone
        # the store built, prepared once, then replayed
        from vecstore.engine.batch_steady import stack_steady

        stacked = store._queries._batch_views.view(seqs, 0)
        steady = stack_steady(seqs, 0)
        prep = executor.prepare(stacked, store.config.for_layer(0), store.index_for(0))
        static_q = queries[0].contiguous()
        if prep.buffer is not None:
            prep.buffer.bookkeeper.wait()
        # as decode.py: the block cache's bookkeeping runs around the replay, not in it
        graph, _ = capture(lambda: executor.decode(prep, steady, static_q, SCALE))

        def replay(x: torch.Tensor) -> None:
            static_q.copy_(x)
            if prep.buffer is not None:
                prep.buffer.begin_step()
            graph.replay()
            if prep.buffer is not None:
                prep.buffer.finish_step()

        captured = _loop(replay, queries, reps)
        row = {"batch": batch, "context": tokens, "kvstore": kind, "executor":
               type(executor).__name__, "store_query_ms": user, "captured_ms": captured,
               "user_over_captured": user / captured}
        if kind == "memory":
            keys, values = view.keys, view.values
            row["sdpa_ms"] = _loop(lambda x: F.scaled_dot_product_attention(
                x, keys, values, enable_gqa=True), queries4, reps)
            row["speedup_vs_sdpa"] = row["sdpa_ms"] / user
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", default=["1x131072", "8x131072"],
                        help="BATCHxTOKENS with GPU-resident rows")
    parser.add_argument("--pinned", nargs="*", default=["8x131072"],
                        help="BATCHxTOKENS with rows in pinned host memory")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for kind, sizes in (("memory", args.sizes), ("pinned", args.pinned)):
        for size in sizes:
            batch, tokens = (int(x) for x in size.split("x"))
            rows.append(run(batch, tokens, kind, args.reps))
            print_row(rows[-1])
    meta = {**machine(), "heads": [HQ, HKV], "reps": args.reps}
    columns = ["batch", "context", "kvstore", "executor", "store_query_ms", "captured_ms",
               "user_over_captured", "sdpa_ms", "speedup_vs_sdpa"]
    write_results(args.out, "store_query", meta, rows, columns, title="Store.query against "
                  "the captured step and SDPA (one layer, wall time per call in a loop)")


if __name__ == "__main__":
    main()
