"""One layer's decode step on the CPU: ``Store.query`` (the default configuration, whose
executor is the fused Numba step there) beside the executors it may run (``numba``,
``torch``, the reference) and full attention done the fastest way torch offers on the CPU
over preallocated ``[B, Hkv, T, D]`` KV: the faster of ``scaled_dot_product_attention``
with GQA and a grouped matmul (``[G, D] @ [D, T]`` per KV head, softmax, ``@ [T, D]``), which
reads each KV head once for its ``G`` query heads; all in one process.

Each figure is the median over 5 rounds of the wall time per call of a loop of calls,
queries drifting between calls. Shapes: SmolLM2-135M's attention (9 query heads, 3 KV
heads, d = 64; the demo's model) and Llama-3-8B's (32 / 8 / 128), float32.

    python benchmarks/cpu_decode.py --sizes smollm2:1x7000 smollm2:1x32768 llama:1x32768
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import machine, print_row, write_results
from vecstore import Store
from vecstore.engine.batch_steady import stack_steady
from vecstore.executor.numba_exec import NumbaExecutor
from vecstore.executor.torch_ref import TorchExecutor

RESULTS = Path(__file__).parent / "results"
SHAPES = {"smollm2": (9, 3, 64), "llama": (32, 8, 128)}  # query heads, KV heads, head dim


def _loop(fn: Callable[[torch.Tensor], object], queries: list[torch.Tensor],
          reps: int) -> float:
    """Median over 5 rounds of the wall milliseconds per call of ``reps`` calls."""
    for q in queries[:3]:
        fn(q)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(reps):
            fn(queries[i % len(queries)])
        rounds.append((time.perf_counter() - start) * 1e3 / reps)
    return sorted(rounds)[2]


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Exact decode attention of ``q [B, Hq, 1, D]`` over ``[B, Hkv, T, D]`` KV, each KV
    head's ``G`` query heads as one ``[G, D]`` matrix."""
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    logits = q.reshape(B, Hkv, Hq // Hkv, D) @ keys.transpose(-1, -2)
    return (torch.softmax(logits * scale, -1) @ values).reshape(B, Hq, 1, D)


def run(model: str, batch: int, tokens: int, reps: int) -> dict:
    hq, hkv, dim = SHAPES[model]
    gen = torch.Generator().manual_seed(batch * 7 + tokens)
    keys = torch.randn(batch, hkv, tokens, dim, generator=gen)
    values = torch.randn(batch, hkv, tokens, dim, generator=gen)
    queries = [torch.randn(batch, hq, 1, dim, generator=gen)]
    for _ in range(15):
        step = torch.randn(queries[-1].shape, generator=gen)
        queries.append(0.9 * queries[-1] + (1 - 0.9 ** 2) ** 0.5 * step)
    scale = dim ** -0.5
    with Store.open() as store:  # the default configuration
        seqs = []
        for b in range(batch):
            seq = store.create(f"s{b}", num_layers=1, num_kv_heads=hkv, head_dim=dim,
                               dtype=torch.float32)
            seq.append(0, keys[b], values[b])  # builds the wave index
            seqs.append(seq)
        executor = type(store.executor).__name__
        user = _loop(lambda x: store.query(seqs, 0, x), queries, reps)
        # the executors, called as the store calls them, on the store's own view and zones
        engine = store._queries
        view = engine._batch_views.view(seqs, 0)
        steady = stack_steady(seqs, 0)
        index, layer = engine._layer(0)
        numba_ex = NumbaExecutor()
        fused = _loop(lambda x: numba_ex.run(index, view, steady, x, scale, layer), queries,
                      reps)
        ref_ex = TorchExecutor()
        reference = _loop(lambda x: ref_ex.run(index, view, steady, x, scale, layer), queries,
                          max(1, reps // 5))
        stats = store.query(seqs, 0, queries[0]).stats
    sdpa = _loop(lambda x: F.scaled_dot_product_attention(x, keys, values, scale=scale,
                                                          enable_gqa=True), queries, reps)
    grouped = _loop(lambda x: _grouped_attention(x, keys, values, scale), queries, reps)
    full = min(sdpa, grouped)
    return {"model": model, "batch": batch, "context": tokens, "executor": executor,
            "store_query_ms": user, "numba_ms": fused, "torch_ref_ms": reference,
            "sdpa_ms": sdpa, "grouped_ms": grouped, "full_ms": full,
            "speedup_vs_full": full / user,
            "user_over_numba": user / fused, "numba_vs_torch_ref": reference / fused,
            "exact_fraction": stats.tokens_exact / stats.tokens_total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*",
                        default=["smollm2:1x7000", "smollm2:1x32768", "smollm2:4x32768",
                                 "llama:1x32768"],
                        help="MODEL:BATCHxTOKENS, MODEL one of " + ", ".join(SHAPES))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        model, shape = size.split(":")
        batch, tokens = (int(x) for x in shape.split("x"))
        rows.append(run(model, batch, tokens, args.reps))
        print_row(rows[-1])
    meta = {**machine(), "torch_threads": torch.get_num_threads(), "reps": args.reps}
    columns = ["model", "batch", "context", "executor", "store_query_ms", "numba_ms",
               "torch_ref_ms", "sdpa_ms", "grouped_ms", "speedup_vs_full", "user_over_numba",
               "numba_vs_torch_ref", "exact_fraction"]
    write_results(args.out, "cpu_decode", meta, rows, columns, title="One layer's decode "
                  "step on the CPU: Store.query, the executors and full attention (wall time "
                  "per call in a loop; speed-up over the faster full attention)")


if __name__ == "__main__":
    main()
