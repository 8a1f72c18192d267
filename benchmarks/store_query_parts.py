"""Where a ``Store.query`` call's wall time goes: each step of its path timed on its own.

``store_query.py`` sets ``Store.query`` beside the privately captured step; this times the
layers between the two, outer to inner, each as the wall time per call of a loop (host work
included, as a decode loop sees it): the public call, its checks, the query engine, the
batch's stacked view, the steady zone, the executor, the prepared view's lookup, the graph
replay with its input copies, the bare ``CUDAGraph.replay`` and the three clones of the
outputs; then a ``cProfile`` of the public call by internal time. One layer of the
Llama-3-8B attention shape, default configuration, KV on the GPU. Needs CUDA.

    python benchmarks/store_query_parts.py [--sizes 1x131072 8x131072] [--reps 2000]
        [--out DIR]

Writes ``store_query_parts.txt`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine  # noqa: E402
from benchmarks.decode_setup import HKV, SCALE, make_inputs  # noqa: E402
from vecstore import Store  # noqa: E402
from vecstore.engine.batch_steady import stack_steady  # noqa: E402
from vecstore.executor.wave_graph import replay  # noqa: E402

PROFILE_LINES = 30


def _per_call_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def parts(batch: int, tokens: int, reps: int) -> str:
    """The timings and profile of one ``batch x tokens`` store, as text."""
    dev = torch.device("cuda")
    view, _, q = make_inputs(batch, tokens, dev, seed=7)
    lines = []
    with Store.open(config={"executor": {"device": "cuda"}}) as store:
        seqs = []
        for b in range(batch):
            seq = store.create(f"s{b}", num_layers=1, num_kv_heads=HKV,
                               head_dim=view.keys.shape[-1], dtype=torch.bfloat16)
            seq.append(0, view.keys[b], view.values[b])
            seqs.append(seq)
        q4 = q[:, :, None].contiguous()
        engine, ex = store._queries, store.executor
        store.query(seqs, 0, q4)  # stacks the view, gathers the tails, captures the graph
        stacked, steady = engine._batch_views.view(seqs, 0), stack_steady(seqs, 0)
        index, layer = store.index_for(0), store.config.for_layer(0)
        prep = ex.prepare(stacked, layer, index)
        q3 = q4[:, :, 0]
        assert prep.graph is not None
        graph, res, stats = prep.graph.graph, prep.graph.res, prep.graph.stats
        timed = {
            "store.query": lambda: store.query(seqs, 0, q4),
            "engine.check": lambda: engine.check(seqs, 0, q4, None, finite=False,
                                                 grouped=False),
            "engine.run": lambda: engine.run(seqs, 0, q4, SCALE),
            "batch view": lambda: engine._batch_views.view(seqs, 0),
            "stack_steady": lambda: stack_steady(seqs, 0),
            "executor.run": lambda: ex.run(index, stacked, steady, q4, SCALE, layer),
            "executor.prepare": lambda: ex.prepare(stacked, layer, index),
            "wave_graph.replay": lambda: replay(prep, steady, q3, SCALE, ex.decode),
            "CUDAGraph.replay": graph.replay,
            "3 output clones": lambda: (res.out.clone(), res.lse.clone(), stats.clone()),
        }
        for name, fn in timed.items():
            lines.append(f"B={batch} {name}: {_per_call_us(fn, reps):.1f} us/call")
            print(lines[-1], flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            store.query(seqs, 0, q4)
        prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(PROFILE_LINES)
    return "\n".join(lines) + "\n" + text.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1x131072", "8x131072"],
                        help="BATCHxTOKENS")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("store_query_parts.py times CUDA graph replays: it needs a CUDA device")
    meta = machine()
    out = [f"# Store.query, step by step ({meta['gpu']}, {meta['date']}, torch "
           f"{meta['torch']})"]
    for size in args.sizes:
        batch, tokens = (int(x) for x in size.split("x"))
        out.append(parts(batch, tokens, args.reps))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_query_parts.txt").write_text("\n".join(out))


if __name__ == "__main__":
    main()
