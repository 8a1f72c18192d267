"""Chunked prefill attention through the store against full attention done right.

``--layers`` layers of ``--batch`` rows of ``--context`` tokens (Llama-3-8B attention
shape by default: 32 query heads, 8 KV heads, d=128, bf16), fed ``--chunk`` tokens per row
per forward pass. Only what differs between the caches is timed, per chunk and layer:

- ``full``: full attention as vLLM/SGLang run it: each layer's KV preallocated
  ``[B, Hkv, context, D]``, the chunk written in place, then one SDPA call of the chunk
  over the filled length with a lower-right causal mask (flash attention on CUDA).
- ``wave``: :class:`attention.StoreAttention` (exact attention over the stored prefix and
  the chunk, row by row, then ingestion: index builds in whole segments, placement), one
  row per ``--kvstore`` kind (``memory``, ``pinned``; pinned rows' stored prefixes kept on
  the device across the chunks, bounded by its memory: ``attention.prefill_mirror_gb``'s
  default).
- ``ingest``: the store's appends of the same chunks alone (what the index build and the
  placement cost), as prefill makes them (``whole_segments``); ``ingest_per_update``: as
  before, indexing at every ``update_tokens`` boundary (a segment per chunk).

The model's projections and MLP are left out (the same for every cache), so ``wave /
full`` here bounds the end-to-end prefill ratio from above. Chunks' q, k, v are drawn
before each chunk and not timed; each chunk is timed from a synchronised start to a
synchronised end, and the chunks' times summed.

    python benchmarks/prefill.py [--layers 4] [--batch 8] [--context 131072] [--chunk 2048]
        [--heads 32 8 128] [--kvstore memory pinned] [--variants full wave ingest]
        [--device cuda] [--out DIR]

Writes ``prefill.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attention import StoreAttention  # noqa: E402
from benchmarks.common import (  # noqa: E402
    RESULTS,
    machine,
    print_row,
    write_results,
)
from vecstore import Store  # noqa: E402

VARIANTS = ("full", "wave", "ingest", "ingest_per_update")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def full_step(kv: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> Callable:
    """One layer of a chunk of full attention over preallocated KV (written in place)."""
    def step(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = kv[layer]
        end = start + k.shape[2]
        keys[:, :, start:end].copy_(k)
        values[:, :, start:end].copy_(v)
        return F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], enable_gqa=True,
            attn_mask=causal_lower_right(q.shape[2], end))
    return step


def run(variant: str, kind: str, args: argparse.Namespace, dev: torch.device) -> float:
    """Seconds the prefill's timed part took for one variant."""
    Hq, Hkv, D = args.heads
    B, T, L = args.batch, args.context, args.chunk
    gen = torch.Generator(device=dev).manual_seed(0)
    config: dict = {"kvstore": {"kind": kind}, "executor": {"device": str(dev)}}
    store = Store.open(config=config)
    seqs = [store.create(f"r{b}", num_layers=args.layers, num_kv_heads=Hkv, head_dim=D,
                         dtype=torch.bfloat16) for b in range(B)]
    attn = StoreAttention(store, seqs)
    kv = ([(torch.empty(B, Hkv, T, D, dtype=torch.bfloat16, device=dev),
            torch.empty(B, Hkv, T, D, dtype=torch.bfloat16, device=dev))
           for _ in range(args.layers)] if variant == "full" else [])
    total = 0.0
    try:
        for start in range(0, T, L):
            n = min(L, T - start)
            chunk = [tuple(torch.randn(B, h, n, D, generator=gen, device=dev,
                                       dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
                     for _ in range(args.layers)]
            step = full_step(kv, start) if variant == "full" else None
            _sync(dev)
            t0 = time.perf_counter()
            for layer, (q, k, v) in enumerate(chunk):
                if step is not None:
                    step(layer, q, k, v)
                elif variant == "wave":
                    attn(layer, q, k, v)
                else:
                    store.append_batch(seqs, layer, k, v,
                                       whole_segments=variant == "ingest")
            _sync(dev)
            total += time.perf_counter() - t0
    finally:
        store.close()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=2048, help="tokens per row per pass")
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128],
                        metavar=("HQ", "HKV", "D"))
    parser.add_argument("--kvstore", nargs="+", default=["memory", "pinned"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    dev = torch.device(args.device)
    rows = []
    for variant in args.variants:
        for kind in (["memory"] if variant == "full" else args.kvstore):
            seconds = run(variant, kind, args, dev)
            rows.append({"variant": variant, "kvstore": "-" if variant == "full" else kind,
                         "seconds": seconds})
            print_row(rows[-1])
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    full = next((r["seconds"] for r in rows if r["variant"] == "full"), None)
    for r in rows:
        if full:
            r["over_full"] = r["seconds"] / full
    Hq, Hkv, D = args.heads
    meta = {**machine(), "layers": args.layers, "batch": args.batch, "context": args.context,
            "chunk": args.chunk, "shape": {"q_heads": Hq, "kv_heads": Hkv, "head_dim": D,
                                           "dtype": "bfloat16"},
            "timing": "wall clock per chunk between synchronisations, summed"}
    write_results(args.out, "prefill", meta, rows, ["variant", "kvstore", "seconds",
                                                    "over_full"],
                  f"Chunked prefill attention, {args.layers} layers x {args.batch} x "
                  f"{args.context} tokens, {args.chunk} per row per pass")
    print("\n" + (args.out / "prefill.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
