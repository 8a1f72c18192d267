"""Check the decode kernels against float64 references, then time Triton vs the torch fallback.

Needs only torch and triton and a CUDA device. Llama-3-8B attention shape (32 query heads,
8 KV heads, head dim 128, bf16), 16 tokens per cluster, the default budgets (retrieval 1.8%,
estimation 23.2% of clusters, steady zone 4 + 64 tokens). Per kernel, batch and context it
times both backends interleaved (A B A B ...), each the median of ``triton.testing`` runs:
replayed from a CUDA graph with inputs rotated past the 60 MB L2 when the call can be
captured, otherwise eager ``do_bench`` (which flushes L2 before every run).

Usage::

    python benchmarks/kernels.py --out benchmarks/results/kernels-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, D, TOKENS_PER_CLUSTER = 32, 8, 128, 16
RETRIEVAL, ESTIMATION, STEADY = 0.018, 0.232, 4 + 64
L2_BYTES = 60 * 2**20
MAX_COPIES = 16  # input sets rotated through a captured graph, so small inputs miss L2
KERNELS = (
    "score_centroids",
    "estimate_zone",
    "sparse_decode_attention",
    "sparse_attention_by_clusters",
)
TOLERANCE = 1e-2  # relative L2 error allowed for bf16 inputs


def import_kernels() -> types.ModuleType:
    """Import ``vecstore.kernels`` without the store's own dependencies if they are missing."""
    sys.path.insert(0, str(ROOT))
    try:
        import vecstore.kernels as kernels
    except ImportError:
        # vecstore/__init__ imports the store (SQLAlchemy, ...); the kernels need torch + triton.
        for name in [m for m in sys.modules if m == "vecstore" or m.startswith("vecstore.")]:
            del sys.modules[name]
        package = types.ModuleType("vecstore")
        package.__path__ = [str(ROOT / "vecstore")]
        sys.modules["vecstore"] = package
        import vecstore.kernels as kernels
    return kernels


K = import_kernels()


# -- workloads --------------------------------------------------------------------------------
def make_inputs(batch: int, tokens: int, gen: torch.Generator) -> dict[str, torch.Tensor | int]:
    """Random inputs of one decode step (never zeros), on the GPU, bf16."""
    dev = "cuda"
    clusters = tokens // TOKENS_PER_CLUSTER
    retrieved = math.ceil(RETRIEVAL * clusters)
    estimated = math.ceil(ESTIMATION * clusters)
    rows = STEADY + retrieved * TOKENS_PER_CLUSTER

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)

    order = torch.argsort(torch.rand(batch, HKV, clusters, device=dev, generator=gen), dim=-1)
    return {
        "q": randn(batch, HQ, D),
        "centroids": randn(batch, HKV, clusters, D),
        "sizes": torch.full((batch, HKV, clusters), TOKENS_PER_CLUSTER, device=dev),
        "value_sums": randn(batch, HKV, clusters, D) * TOKENS_PER_CLUSTER,
        "logits": 2 * torch.randn(batch, HQ, clusters, device=dev, generator=gen),
        "est_ids": order[..., retrieved : retrieved + estimated].contiguous(),
        "k_buf": randn(batch, HKV, rows, D),
        "v_buf": randn(batch, HKV, rows, D),
        "lengths": torch.full((batch, HKV), rows, device=dev),
        "starts": order[..., :retrieved].contiguous() * TOKENS_PER_CLUSTER,
        "counts": torch.full((batch, HKV, retrieved), TOKENS_PER_CLUSTER, device=dev),
        "k": math.ceil((RETRIEVAL + ESTIMATION) * clusters),
    }


def make_store(batch: int, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Cluster-contiguous keys and values ``[B, Hkv, tokens, D]`` for in-place reads."""
    shape = (batch, HKV, tokens, D)
    return tuple(
        torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)
    )


def kernel_calls(x: dict, store: tuple | None, backend: str) -> dict[str, Callable[[], object]]:
    """One zero-argument call per kernel, for ``backend``."""
    scale = D**-0.5
    calls = {
        "score_centroids": lambda: K.score_centroids(
            x["q"], x["centroids"], x["sizes"], scale, x["k"], backend=backend
        ),
        "estimate_zone": lambda: K.estimate_zone(
            x["logits"], x["sizes"], x["value_sums"], x["est_ids"], backend=backend
        ),
        "sparse_decode_attention": lambda: K.sparse_decode_attention(
            x["q"], x["k_buf"], x["v_buf"], x["lengths"], scale, backend=backend
        ),
    }
    if store is not None:
        calls["sparse_attention_by_clusters"] = lambda: K.sparse_attention_by_clusters(
            x["q"], store[0], store[1], x["starts"], x["counts"], scale, backend=backend
        )
    return calls


def ideal_bytes(kernel: str, x: dict) -> int:
    """Bytes a kernel must move at least (reads of its data plus its outputs)."""
    batch, clusters = x["sizes"].shape[0], x["sizes"].shape[2]
    if kernel == "score_centroids":
        return x["centroids"].nbytes + x["sizes"].nbytes + batch * HQ * clusters * 4
    if kernel == "estimate_zone":
        est = x["est_ids"].shape[-1]
        return batch * HKV * est * (D * 2 + 8 + 8) + batch * HQ * est * 4
    if kernel == "sparse_decode_attention":
        return x["k_buf"].nbytes + x["v_buf"].nbytes
    return 2 * batch * HKV * x["starts"].shape[-1] * TOKENS_PER_CLUSTER * D * 2


# -- correctness ------------------------------------------------------------------------------
def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return math.inf
    return float((x.double() - ref).norm() / ref.norm())


def ref_attention(q, keys, values, valid, scale):
    """Float64 ``(out, lse)`` of ``q [B, Hq, D]`` over rows of ``[B, Hkv, T, D]`` where valid."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    s = torch.einsum("bhd,bhtd->bht", q.double(), k) * scale
    s = s.masked_fill(~valid.repeat_interleave(group, 1), float("-inf"))
    return torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def check_all(gen: torch.Generator) -> dict[str, float]:
    """Relative L2 errors of every Triton kernel against float64 on a small Llama-shaped step."""
    x = make_inputs(2, 32768, gen)
    keys, values = make_store(2, 32768, gen)
    scale, group = D**-0.5, HQ // HKV
    errors = {}
    logits, top_ids = K.score_centroids(x["q"], x["centroids"], x["sizes"], scale, x["k"])
    cents = x["centroids"].double().repeat_interleave(group, 1)
    ref_logits = torch.einsum("bhd,bhcd->bhc", x["q"].double(), cents) * scale
    errors["score_centroids.logits"] = rel_l2(logits, ref_logits)
    score = torch.softmax(ref_logits, -1).view(2, HKV, group, -1).sum(2)
    best = score.topk(x["k"], -1).values.sum(-1)
    errors["score_centroids.selection"] = float(
        (1 - score.gather(-1, top_ids).sum(-1) / best).abs().max()
    )
    out, lse = K.estimate_zone(x["logits"], x["sizes"], x["value_sums"], x["est_ids"])
    ids = x["est_ids"].repeat_interleave(group, 1)
    w = x["logits"].double().gather(-1, ids) + math.log(TOKENS_PER_CLUSTER)
    vs = x["value_sums"].double().gather(2, x["est_ids"][..., None].expand(-1, -1, -1, D))
    ref = torch.einsum("bhe,bhed->bhd", torch.softmax(w, -1), vs.repeat_interleave(group, 1))
    errors["estimate_zone.out"] = rel_l2(out, ref / TOKENS_PER_CLUSTER)
    errors["estimate_zone.lse"] = rel_l2(lse, torch.logsumexp(w, -1))
    rows = torch.arange(x["k_buf"].shape[2], device="cuda")
    lengths = torch.randint(0, rows.numel() + 1, (2, HKV), device="cuda", generator=gen)
    out, lse = K.sparse_decode_attention(x["q"], x["k_buf"], x["v_buf"], lengths, scale)
    ref_out, ref_lse = ref_attention(
        x["q"], x["k_buf"], x["v_buf"], rows < lengths[..., None], scale
    )
    live = torch.isfinite(ref_lse)
    errors["sparse_decode_attention.out"] = rel_l2(out[live], ref_out[live])
    errors["sparse_decode_attention.lse"] = rel_l2(lse[live], ref_lse[live])
    out, lse = K.sparse_attention_by_clusters(x["q"], keys, values, x["starts"], x["counts"], scale)
    valid = torch.zeros(2, HKV, keys.shape[2], dtype=torch.bool, device="cuda")
    valid.scatter_(2, (x["starts"][..., None] + torch.arange(16, device="cuda")).flatten(2), True)
    ref_out, ref_lse = ref_attention(x["q"], keys, values, valid, scale)
    errors["sparse_attention_by_clusters.out"] = rel_l2(out, ref_out)
    errors["sparse_attention_by_clusters.lse"] = rel_l2(lse, ref_lse)
    return errors


# -- timing -----------------------------------------------------------------------------------
def time_call(calls: list[Callable[[], object]], graph: bool) -> float:
    """Median ms of a call: CUDA-graph replay rotating over ``calls`` (same work, different
    inputs, so L2 does not hold them), or eager ``do_bench`` (which flushes L2 itself)."""
    if not graph:
        return float(triton.testing.do_bench(calls[0], return_mode="median"))
    turn = iter(range(10**12))

    def rotated() -> object:
        return calls[next(turn) % len(calls)]()

    return float(triton.testing.do_bench_cudagraph(rotated, return_mode="median"))


def bench(batches: list[int], contexts: list[int], rounds: int, max_gib: float) -> list[dict]:
    """Time every kernel on both backends for each context and batch; print table rows."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for tokens in contexts:
        for batch in batches:
            store_bytes = 2 * batch * HKV * tokens * D * 2
            fits = store_bytes <= max_gib * 2**30
            x = make_inputs(batch, tokens, gen)
            copies = {
                k: min(MAX_COPIES, math.ceil(3 * L2_BYTES / ideal_bytes(k, x))) for k in KERNELS
            }
            extra = [make_inputs(batch, tokens, gen) for _ in range(max(copies.values()) - 1)]
            inputs = [x, *extra]
            store = make_store(batch, tokens, gen) if fits else None
            for kernel in kernel_calls(x, store, "torch"):
                # The torch by-cluster fallback reads lengths.max() on the host: not capturable.
                graph = {"triton": True, "torch": kernel != "sparse_attention_by_clusters"}
                times: dict[str, list[float]] = {"triton": [], "torch": []}
                for _ in range(rounds):
                    for backend in ("triton", "torch"):
                        calls = [
                            kernel_calls(inputs[i], store, backend)[kernel]
                            for i in range(copies[kernel])
                        ]
                        times[backend].append(time_call(calls, graph[backend]))
                tri, ref = statistics.median(times["triton"]), statistics.median(times["torch"])
                nbytes = ideal_bytes(kernel, x)
                mode = {b: "graph" if graph[b] else "eager" for b in graph}
                results.append({
                    "kernel": kernel, "batch": batch, "tokens": tokens,
                    "clusters": tokens // TOKENS_PER_CLUSTER, "triton_ms": tri, "torch_ms": ref,
                    "triton_mode": mode["triton"], "torch_mode": mode["torch"],
                    "input_copies": copies[kernel], "speedup": ref / tri, "bytes": nbytes,
                    "triton_tb_per_s": nbytes / tri / 1e9,
                })  # fmt: skip
                print(
                    f"| {kernel} | {batch} | {tokens // 1024}K "
                    f"| {tri * 1e3:.1f} ({mode['triton']}) | {ref * 1e3:.1f} ({mode['torch']}) "
                    f"| {ref / tri:.2f}x | {nbytes / tri / 1e9:.2f} |",
                    flush=True,
                )
            if not fits:
                print(
                    f"| sparse_attention_by_clusters | {batch} | {tokens // 1024}K | skipped: "
                    f"store of {store_bytes / 2**30:.0f} GiB > --max-gib | | | |"
                )
            del inputs, extra, x, store
            torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per backend")
    parser.add_argument(
        "--max-gib",
        type=float,
        default=40.0,
        help="largest cluster-contiguous K+V store to allocate for in-place reads",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    errors = check_all(torch.Generator(device="cuda").manual_seed(1))
    print("## correctness (relative L2 error vs float64, bf16 inputs)")
    for name, err in errors.items():
        print(f"- {name}: {err:.2e} {'ok' if err < TOLERANCE else 'FAIL'}")
    print("\n## timing (µs, median; speedup = torch / triton; TB/s = ideal bytes / triton time)")
    print("| kernel | B | context | triton µs | torch µs | speedup | TB/s |")
    print("|---|---|---|---|---|---|---|")
    results = bench(args.batches, args.contexts, args.rounds, args.max_gib)
    passed = all(err < TOLERANCE for err in errors.values())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                        "python": platform.python_version()},
            "versions": {"torch": torch.__version__, "triton": triton.__version__,
                         "cuda": torch.version.cuda},
            "settings": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16",
                         "tokens_per_cluster": TOKENS_PER_CLUSTER, "retrieval": RETRIEVAL,
                         "estimation": ESTIMATION, "steady": STEADY, "rounds": args.rounds,
                         "batches": args.batches, "contexts": args.contexts,
                         "max_gib": args.max_gib, "l2_bytes": L2_BYTES},
            "correctness": {"rel_l2": errors, "tolerance": TOLERANCE, "passed": passed},
            "results": results,
        }, indent=2))  # fmt: skip
        print(f"\nwrote {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
