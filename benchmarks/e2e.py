"""End-to-end decode throughput: the wave cache against full attention done right, one model.

A Llama model built from a Llama-3-8B-shaped config (hidden 4096, 32 q heads, 8 KV heads,
d=128, MLP 14336, vocab 128256, bf16) with random weights -- timing does not depend on the
weights -- and ``--layers`` decoder layers (4 for batch scaling; 32 is the real model's
shape). Prefill of ``--context`` random tokens per sequence, then ``--steps`` greedy decode
steps after ``WARMUP_STEPS`` untimed ones (the first compiles kernels and captures CUDA
graphs); decode tokens/s counts ``batch * steps`` over the timed decode loop only.

The prompt is prefilled in chunks through the same cache (:func:`prefill`): each forward
pass feeds ``max(1, --prefill-chunk // batch)`` tokens of every row (``--prefill-chunk``
counts tokens per forward pass over the whole batch, 16384 by default), so the prefill's
activations stay bounded and large batches fit; ``--prefill-chunk 0`` prefills in one
pass. A cache that runs out of GPU memory is recorded as ``oom`` and the run goes on.

Caches (``--caches``):

- ``full``: full attention as vLLM and SGLang run it, the baseline every ratio divides by
  (:mod:`benchmarks.full_attention`: KV preallocated and written in place, flash attention
  over the filled length, prefill included; the decode step -- every layer, the whole
  forward -- captured in one CUDA graph and replayed, :mod:`benchmarks.full_graph`). Its
  decode is timed once per ``--full-splits`` value (how many parts flash decoding splits
  each row's keys into, one graph each, on the same cache) and the fastest is its row;
- ``wave``: :class:`integrations.hf.WaveCache` with the ``wave`` executor, KV on the GPU;
- ``wave-pinned``: the same with ``kvstore.kind = "pinned"`` (KV in pinned host memory,
  served through the GPU block cache; its prefill keeps the rows' stored prefixes on the
  GPU across the chunks, as much as the GPU holds: ``attention.prefill_mirror_gb``'s
  default);
- ``dynamic``, ``static``: transformers' ``DynamicCache`` / ``StaticCache`` with ``sdpa``
  ("transformers' defaults": reported, never a baseline).

Each row is one cache at one batch (:mod:`benchmarks.e2e_report`): tokens/s and its ratio to
``full`` at the same batch (``vs_full``), the decode step's wall time and the time the GPU
was busy in it (``gpu_ms``, from the profiler over a few more steps; ``wall_over_gpu`` > 1 is
time the GPU waited for the host), the prefill time and its ratio to ``full``'s, the time
to the first token after the prompt's (``first_step_s``: that step, and what it does once
-- indexing the tails' last segment, stacking the batch's views, compiling, capturing
graphs), the KV
bytes the attention reads per step over all layers (``kv_read_gbs``: the whole filled KV for
``full`` and ``dynamic``, the preallocated length for ``static``, the rows read exactly
for the wave caches, whose centroids and value sums come on top) against the HBM copy
bandwidth measured at the start (``hbm_copy_gbs`` in the JSON's meta), and the largest batch
each cache ran with its ratio to ``full``'s largest; ``wave-pinned`` rows also give
``hit_rate``, the share of retrieved clusters its GPU block caches held over every decode
step (:meth:`~vecstore.executor.wave_exec.WaveExecutor.buffer_stats`), their
``cache_capacity`` and ``vs_resident``, their tokens/s over the resident ``wave`` row's at
the same batch; ``--cache-capacities`` runs ``wave-pinned`` once per block-cache capacity
(the fraction of each layer's clusters it holds). ``--profile`` also
writes, per cache and batch, ``e2e_profiles/e2e_profile_<cache>_b<batch>.txt`` under
``--out``. ``--profile-prefill`` (CUDA) runs each prefill under the profiler and reports
``prefill_gpu_s``, the seconds the GPU was busy in it, with its busiest kernels in
``e2e_profiles/e2e_profile_<cache>_b<batch>_prefill.txt``: a prefill whose unprofiled time
(another run's ``prefill_s``; the profiler slows a pinned prefill about threefold) is well
above it is the GPU waiting for the host.
``--compile-layers`` runs the decode steps of ``full`` and the wave caches alike with the
model's decoder layers compiled around their attention
(:class:`integrations.hf.layer_compile.CompiledLayers`). Every layer's query, key and
value projections run as one GEMM, as serving engines store them
(:func:`integrations.hf.fused_qkv.fuse_qkv`), for every cache alike: the baseline is the
fastest way to run the model (``--separate-qkv``: the model's own three GEMMs). Every step
picks its next tokens greedily (:func:`benchmarks.e2e_models.greedy`).

Writes ``e2e.{json,md,png}`` under ``--out`` (default ``benchmarks/results``).

    python benchmarks/e2e.py [--context 131072] [--batches 1 8 ...] [--layers 4]
                             [--steps 128] [--prefill-chunk 16384]
                             [--caches full wave wave-pinned dynamic static]
                             [--full-splits 0 2 4 8] [--cache-capacities 0.05 0.25]
                             [--compile-layers] [--separate-qkv] [--profile]
                             [--profile-prefill]
                             [--out DIR]
                             [--model tiny --device cpu]   (a CPU run, as the tests do)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

# before CUDA starts: growing caches (DynamicCache's concatenations, the store's segments)
# otherwise leave tens of GB reserved but unusable, and large batches fail for fragmentation
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, Timer, ceilings, machine  # noqa: E402
from benchmarks.e2e_models import (  # noqa: E402
    MODELS,
    block_cache_hit_rate,
    build_model,
    greedy,
    make_cache,
    make_step,
)
from benchmarks.e2e_profile import PROFILE_STEPS, profile_prefill, profile_steps  # noqa: E402
from benchmarks.e2e_report import CACHES, kv_read_gb, largest, with_ratios, write  # noqa: E402
from benchmarks.flash_varlen import SPLITS_SUPPORTED  # noqa: E402
from integrations.hf.cache import cache_kwarg  # noqa: E402
from integrations.hf.fused_qkv import fuse_qkv  # noqa: E402
from vecstore.config import CacheConfig  # noqa: E402

MAX_BATCH = 64
WARMUP_STEPS = 4  # untimed decode steps before the timed ones, for every cache
DEFAULT_CAPACITY = CacheConfig().capacity  # wave-pinned's block caches without --cache-capacities


def chunk_length(batch: int, prefill_chunk: int, context: int) -> int:
    """Tokens of each row per prefill forward pass (``prefill_chunk`` = 0: all at once)."""
    return context if prefill_chunk <= 0 else max(1, min(context, prefill_chunk // batch))


@torch.inference_mode()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids [B, T]`` to ``model`` through ``cache`` in chunks of ``chunk`` tokens per
    row; returns the last position's logits ``[B, 1, V]``."""
    out = None
    for start in tqdm(range(0, ids.shape[1], chunk), desc=f"prefill {ids.shape[0]} x "
                      f"{ids.shape[1]}", unit="chunk", mininterval=10.0, leave=False):
        out = model(input_ids=ids[:, start:start + chunk], use_cache=True, logits_to_keep=1,
                    **{cache_kwarg(model): cache})
    assert out is not None
    return out.logits[:, -1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run(name: str, model, cache, ids: torch.Tensor, steps: int, chunk: int,
        profile_to: Path | None = None, splits: tuple[int, ...] = (0,), *,
        compile_layers: bool = False, prefill_profile_to: Path | None = None) -> dict:
    """Prefill ``ids`` through ``cache``, then time ``steps`` decode steps (``full``: of each
    number of flash-decoding ``splits`` in turn, keeping the fastest); the GPU's busy time
    per step from :data:`PROFILE_STEPS` more (written out with ``profile_to``); with
    ``prefill_profile_to``, the prefill's device time too (:func:`profile_prefill`)."""
    device = ids.device
    _sync(device)
    t0 = time.perf_counter()
    with profile_prefill(device, prefill_profile_to) as prefill_busy:
        logits = prefill(model, cache, ids, chunk)
        _sync(device)
    prefill_s = time.perf_counter() - t0
    nxt = greedy(logits[:, -1])
    del logits
    if name != "full" or not SPLITS_SUPPORTED:  # an older PyTorch: its own choice only
        splits = (0,)
    # the first token after the prompt's: the step and what it does once (the tails'
    # last segment indexed, the batch's stacked views built, compilation, graph capture)
    t0 = time.perf_counter()
    first = make_step(name, model, cache, splits[0], compile_layers=compile_layers)
    nxt = first(nxt)
    _sync(device)
    first_step_s = time.perf_counter() - t0
    variants = {splits[0]: first} | {
        n: make_step(name, model, cache, n, compile_layers=compile_layers)
        for n in splits[1:]}
    decode: dict[int, float] = {}
    filled: dict[int, int] = {}  # tokens a row holds when the timed steps start
    for n, step in variants.items():
        for _ in range(WARMUP_STEPS):  # kernel compilation, CUDA graph capture, allocator
            nxt = step(nxt)
        _sync(device)
        filled[n] = cache.get_seq_length()
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = step(nxt)
        _sync(device)
        decode[n] = time.perf_counter() - t0
    best = min(decode, key=decode.__getitem__)
    nxt, gpu_ms = profile_steps(variants[best], nxt, device, profile_to)
    res = {"prefill_s": prefill_s, "first_step_s": first_step_s, "decode_s": decode[best],
           "tokens_per_s": ids.shape[0] * steps / decode[best],
           "step_ms": decode[best] / steps * 1e3, "mean_tokens": filled[best] + steps // 2}
    if name == "full":
        res["num_splits"] = best
        res["step_ms_by_splits"] = {n: t / steps * 1e3 for n, t in decode.items()}
    if gpu_ms is not None:
        res["gpu_ms"] = gpu_ms
    if prefill_busy:
        res["prefill_gpu_s"] = prefill_busy[0]
    if device.type == "cuda":
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return res


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure(args: argparse.Namespace, model, name: str, batch: int, ids: torch.Tensor,
            row: dict) -> None:
    """Run cache ``name`` at ``batch`` into ``row`` (``error`` if it failed)."""
    device = ids.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    capacity = row.get("cache_capacity") if args.cache_capacities else None
    label = name if capacity is None else f"{name}_c{capacity:g}"
    profile_to = args.out / "e2e_profiles" / f"e2e_profile_{label}_b{batch}.txt"
    variants = len(args.full_splits) if name == "full" and SPLITS_SUPPORTED else 1
    length = args.context + 1 + variants * (WARMUP_STEPS + args.steps) + 2 * PROFILE_STEPS
    cache = None
    try:
        cache = make_cache(name, model, batch, length, compile_layers=args.compile_layers,
                           cache_capacity=capacity)
        res = run(name, model, cache, ids, args.steps, row["prefill_chunk"],
                  profile_to if args.profile else None, tuple(args.full_splits),
                  compile_layers=args.compile_layers,
                  prefill_profile_to=profile_to if args.profile_prefill else None)
        if name.startswith("wave"):
            res["exact_fraction"] = cache.decode_stats.exact_fraction
        hit_rate = block_cache_hit_rate(name, cache)
        if hit_rate is not None:
            res["hit_rate"] = hit_rate
        tokens = length if name == "static" else res["mean_tokens"]
        res["kv_read_gb"] = kv_read_gb(model.config, name, batch, tokens, res)
        res["kv_read_gbs"] = res["kv_read_gb"] / res["step_ms"] * 1e3
        row.update(res)
        print(name, batch, res, flush=True)
    except Exception as exc:  # report and carry on with the other caches
        oom = _is_oom(exc)
        print(f"{name} batch {batch}: {'oom' if oom else ''} {type(exc).__name__}: "
              f"{str(exc)[:300]}", flush=True)
        row["error"] = "oom" if oom else f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:  # free the failed (or finished) cache's memory before the next one
        if cache is not None and hasattr(cache, "close"):
            cache.close()
        cache = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                        help=f"batch sizes, 1 to {MAX_BATCH}")
    parser.add_argument("--layers", type=int, default=4,
                        help="decoder layers (32: the Llama-3-8B shape)")
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps")
    parser.add_argument("--prefill-chunk", type=int, default=16384,
                        help="prompt tokens per prefill forward pass, summed over the batch "
                             "(0 = the whole prompt in one pass)")
    parser.add_argument("--caches", nargs="+", choices=CACHES,
                        default=["full", "wave", "wave-pinned", "dynamic"],
                        help="which caches to run, in this order at each batch (ratios "
                             "divide by full, so include it)")
    parser.add_argument("--full-splits", type=int, nargs="+", default=[0, 2, 4, 8],
                        help="full: flash-decoding splits of each row's keys to time, the "
                             "fastest kept (0: FlashAttention's own choice)")
    parser.add_argument("--cache-capacities", type=float, nargs="+", default=None,
                        help="wave-pinned: run it once per block-cache capacity (cache."
                             "capacity, a fraction of each layer's clusters; default: the "
                             "config's)")
    parser.add_argument("--compile-layers", action="store_true",
                        help="full and wave caches: decode steps run the decoder layers "
                             "compiled around their attention (torch.compile; "
                             "WaveCache(compile_layers=True))")
    parser.add_argument("--separate-qkv", dest="fuse_qkv", action="store_false",
                        help="run each layer's query, key and value projections as the "
                        "model's own three GEMMs (default: fused into one, "
                        "integrations.hf.fused_qkv.fuse_qkv, for every cache alike)")
    parser.add_argument("--profile", action="store_true",
                        help="also write a profile of a few decode steps of each cache and batch")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="CUDA: run each prefill under the profiler and report the time the "
                             "GPU was busy in it (prefill_gpu_s; the prefill itself is slowed)")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b",
                        help="model shape (tiny: for runs on the CPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if any(not 1 <= b <= MAX_BATCH for b in args.batches):
        parser.error(f"--batches: each must be between 1 and {MAX_BATCH}")
    if args.layers < 1 or args.context < 1 or args.steps < 1:
        parser.error("--layers, --context and --steps must be at least 1")
    if len(set(args.caches)) != len(args.caches):
        parser.error("--caches: name each cache once")
    if args.cache_capacities and any(not 0 < c <= 1 for c in args.cache_capacities):
        parser.error("--cache-capacities: each must be in (0, 1]")
    if any(not 0 <= n <= 128 for n in args.full_splits):
        parser.error("--full-splits: each must be between 0 and 128")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    ceil: dict[str, float] = {}
    if dev.type == "cuda":  # before the model: the timer's buffers are freed after
        ceil = ceilings(dev, Timer(dev))
        print("ceilings", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    model = build_model(args.layers, args.model, args.device)
    if args.fuse_qkv:
        fuse_qkv(model)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []
    for batch in args.batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, args.context), generator=gen,
                            device=dev)
        for name in args.caches:
            pinned = name == "wave-pinned"
            for capacity in (args.cache_capacities or [DEFAULT_CAPACITY]) if pinned else [None]:
                row = {"batch": batch, "context": args.context, "layers": args.layers,
                       "cache": name,
                       "prefill_chunk": chunk_length(batch, args.prefill_chunk, args.context)}
                if pinned:
                    row["cache_capacity"] = capacity
                rows.append(row)
                measure(args, model, name, batch, ids, row)
                save(args, rows, ceil)  # after every run: one stopped early keeps the rest
        del ids
    print("\n" + (args.out / "e2e.md").read_text(), flush=True)


def save(args: argparse.Namespace, rows: list[dict], ceil: dict[str, float]) -> None:
    """Write ``e2e.{json,md,png}`` of the rows measured so far."""
    import transformers

    rows = with_ratios(rows)
    meta = {**machine(), **ceil, "transformers": transformers.__version__,
            "model": f"{args.model} shape, random weights, bf16", "steps": args.steps,
            "warmup_steps": WARMUP_STEPS, "profile_steps": PROFILE_STEPS,
            "layers": args.layers, "prefill_chunk": args.prefill_chunk,
            "compile_layers": args.compile_layers, "fuse_qkv": args.fuse_qkv,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default",
            "largest": largest(rows)}
    write(args.out, meta, rows)


if __name__ == "__main__":
    main()
