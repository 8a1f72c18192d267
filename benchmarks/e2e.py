"""End-to-end decode throughput: transformers + SDPA vs the wave cache, same model, same run.

A Llama model built from a Llama-3-8B-shaped config (hidden 4096, 32 q heads, 8 KV heads,
d=128, MLP 14336, vocab 128256, bf16) with random weights — timing does not depend on the
weights — and ``--layers`` decoder layers (the full model has 32; fewer keep the run
inside the device lease, and the per-layer work is the same). Prefill of ``--context``
random tokens per sequence, then ``--steps`` greedy decode steps after ``WARMUP_STEPS``
untimed ones (the first compiles kernels and captures CUDA graphs); decode tokens/s counts
``batch * steps`` over the timed decode loop only.

The prompt is prefilled in chunks through the same cache (:func:`prefill`): each forward
pass feeds ``max(1, --prefill-chunk // batch)`` tokens of every row (``--prefill-chunk``
counts tokens per forward pass over the whole batch, 16384 by default), so the prefill's
activations stay bounded and large batches fit; ``--prefill-chunk 0`` prefills in one
pass. With the wave cache, every chunk after the first also attends to the chunks before
it through the store's query (retrieval and estimation zones, as any continued prompt).
A variant that runs out of GPU memory is recorded as ``oom`` and the run goes on.

- ``sdpa``: transformers' ``DynamicCache`` with ``attn_implementation="sdpa"``;
- ``static``: transformers' ``StaticCache`` (preallocated for the whole run) with ``sdpa``;
- ``wave``: :class:`integrations.hf.WaveCache` with the ``wave`` executor on the GPU.

``speedup`` divides the wave cache's tokens/s by the faster of the two transformers
caches measured at that batch; the run also records the largest batch each cache ran and
the ratio between them (:func:`largest`). Bytes: ``<cache>_kv_read_gb`` is the KV the
attention reads per decode step over all layers — the whole cache for the transformers
caches (``StaticCache`` its preallocated length), the rows read exactly
(``exact_fraction``) for the wave cache, whose centroids and value sums come on top (their
bytes are counted per layer by ``benchmarks/decode.py``) — and ``<cache>_kv_read_gbs`` that
over the step time, against the HBM copy bandwidth measured at the start of the same run
(``hbm_copy_gbs`` in the JSON's meta). ``--profile`` also writes, per cache and batch,
``e2e_profile_<cache>_b<batch>.txt``: the busiest CUDA kernels and host calls of a few
decode steps (``torch.profiler``) and the Python functions they spent the host's time in
(``cProfile``).

Writes ``e2e.{json,md,png}`` under ``--out`` (default ``benchmarks/results``).

    python benchmarks/e2e.py [--context 131072] [--batches 1 8 ...] [--layers 4]
                             [--prefill-chunk 16384] [--caches sdpa static wave]
                             [--profile] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from pathlib import Path

# before CUDA starts: growing caches (DynamicCache's concatenations, the store's segments)
# otherwise leave tens of GB reserved but unusable, and large batches fail for fragmentation
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    Timer,
    ceilings,
    machine,
    plot_pairs,
    write_results,
)
from integrations.hf.cache import cache_kwarg  # noqa: E402


def build_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=1 << 21, rope_theta=500000.0,
                      attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


MAX_BATCH = 64
WARMUP_STEPS = 4  # untimed decode steps before the timed ones, for both caches


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


PROFILE_STEPS = 8


def profile_steps(step, nxt: torch.Tensor, path: Path) -> torch.Tensor:
    """Run ``PROFILE_STEPS`` decode steps under ``torch.profiler`` and ``cProfile``; write
    the top kernels, host operators and Python functions to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            nxt = step(nxt)
        torch.cuda.synchronize()
    py = cProfile.Profile()
    t0 = time.perf_counter()
    py.enable()
    for _ in range(PROFILE_STEPS):
        nxt = step(nxt)
    torch.cuda.synchronize()
    py.disable()
    wall = (time.perf_counter() - t0) / PROFILE_STEPS
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("cumulative").print_stats(45)
    events = prof.key_averages()
    path.write_text(
        f"{PROFILE_STEPS} decode steps; under cProfile {wall * 1e3:.2f} ms/step\n\n"
        "## CUDA time\n" + events.table(sort_by="self_cuda_time_total", row_limit=30)
        + "\n## host time\n" + events.table(sort_by="self_cpu_time_total", row_limit=30)
        + "\n## Python (cProfile, cumulative)\n" + text.getvalue())
    return nxt


@torch.inference_mode()
def run(model, cache, ids: torch.Tensor, steps: int, chunk: int,
        profile_to: Path | None = None) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = prefill(model, cache, ids, chunk)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    nxt = logits.argmax(-1)
    del logits

    def step(nxt: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
        return out.logits[:, -1:].argmax(-1)

    for _ in range(WARMUP_STEPS):  # kernel compilation, CUDA graph capture, allocator growth
        nxt = step(nxt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = step(nxt)
    torch.cuda.synchronize()
    decode = time.perf_counter() - t0
    if profile_to is not None:
        profile_steps(step, nxt, profile_to)
    return {"prefill_s": prefill_s, "decode_s": decode,
            "tokens_per_s": ids.shape[0] * steps / decode,
            "step_ms": decode / steps * 1e3,
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9}


CACHES = ("sdpa", "static", "wave")
BASELINES = ("sdpa", "static")
COLUMNS = ["batch", "context", "layers", "prefill_chunk", "alloc_conf", "sdpa_tokens_per_s",
           "static_tokens_per_s", "wave_tokens_per_s", "speedup", "sdpa_step_ms",
           "static_step_ms", "wave_step_ms", "sdpa_kv_read_gbs", "static_kv_read_gbs",
           "wave_kv_read_gbs", "sdpa_prefill_s", "static_prefill_s", "wave_prefill_s",
           "sdpa_peak_gpu_gb", "static_peak_gpu_gb", "wave_peak_gpu_gb", "wave_exact_fraction",
           "sdpa_error", "static_error", "wave_error"]


def kv_read_gb(config, name: str, batch: int, tokens: int, res: dict) -> float:
    """KV bytes (GB) the attention of ``name`` reads per decode step over all layers, for
    ``batch`` rows of ``tokens`` tokens (``StaticCache``: ``tokens`` is its preallocated
    length; the wave cache: only the rows it reads exactly, ``res["exact_fraction"]``)."""
    per_token = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16
    full = config.num_hidden_layers * batch * tokens * per_token / 1e9
    return full * res["exact_fraction"] if name == "wave" else full


def make_cache(name: str, model, batch_len: int):
    """A fresh cache of kind ``name`` for a run whose rows reach ``batch_len`` tokens."""
    from transformers import DynamicCache, StaticCache

    from integrations.hf import WaveCache

    if name == "sdpa":
        return DynamicCache(config=model.config)
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=batch_len)
    return WaveCache({"executor": {"kind": "wave", "device": "cuda"}}, model)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def largest(rows: list[dict]) -> dict:
    """Per cache, the largest batch it ran and its tokens/s, and the smallest batch that ran
    out of memory (``None`` if none did), over every row measured; with the wave cache and a
    baseline, ``speedup`` divides the wave cache's tokens/s at its largest batch by the best
    baseline's at its own largest (the target's "largest batch each fits")."""
    out: dict = {}
    for name in CACHES:
        ran = [r for r in rows if f"{name}_tokens_per_s" in r]
        if not ran:
            continue
        top = max(ran, key=lambda r: r["batch"])
        oom = [r["batch"] for r in rows if r.get(f"{name}_error") == "oom"]
        out[name] = {"batch": top["batch"], "tokens_per_s": top[f"{name}_tokens_per_s"],
                     "oom_at": min(oom, default=None)}
    base = [out[b]["tokens_per_s"] for b in BASELINES if b in out]
    if "wave" in out and base:
        out["speedup"] = out["wave"]["tokens_per_s"] / max(base)
    return out


NAMES = {"sdpa": "DynamicCache + SDPA", "static": "StaticCache + SDPA",
         "wave": "vecstore wave cache"}


def plot(rows: list[dict], top: dict, path: Path) -> None:
    """Decode tokens/s of every cache per batch (rows where the wave cache and a baseline
    ran; a cache that did not run at a batch shows no bar there), then each cache at the
    largest batch it ran (``top``, from :func:`largest`)."""
    done = [r for r in rows if "speedup" in r]
    if not done and "speedup" not in top:
        return
    labels = [f"batch {r['batch']}\n{r['speedup']:.2f}x" for r in done]
    series = {label: [r.get(f"{name}_tokens_per_s", 0.0) for r in done]
              for name, label in NAMES.items() if name in top}
    if "speedup" in top:
        labels.append("largest batch each\n" + ", ".join(
            f"{name} {top[name]['batch']}" for name in NAMES if name in top)
            + f"\n{top['speedup']:.2f}x")
        for name, label in NAMES.items():
            if name in top:
                series[label].append(top[name]["tokens_per_s"])
    plot_pairs(path, labels, series, "decode tokens/s",
               f"end to end, {rows[0]['context'] // 1024}K context")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                        help=f"batch sizes, 1 to {MAX_BATCH}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=16384,
                        help="prompt tokens per prefill forward pass, summed over the batch "
                             "(0 = the whole prompt in one pass)")
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES),
                        help="which caches to run")
    parser.add_argument("--profile", action="store_true",
                        help="also profile a few decode steps of each cache and batch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if any(not 1 <= b <= MAX_BATCH for b in args.batches):
        parser.error(f"--batches: each must be between 1 and {MAX_BATCH}")
    dev = torch.device("cuda")
    ceil = ceilings(dev, Timer(dev))  # before the model: the timer's buffers are freed after
    print("ceilings", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    model = build_model(args.layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in args.batches:
        chunk = chunk_length(batch, args.prefill_chunk, args.context)
        row: dict = {"batch": batch, "context": args.context, "layers": args.layers,
                     "prefill_chunk": chunk,
                     "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"}
        ids = torch.randint(0, model.config.vocab_size, (batch, args.context), generator=gen,
                            device="cuda")
        rows.append(row)
        for name in args.caches:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            profile_to = (args.out / f"e2e_profile_{name}_b{batch}.txt"
                          if args.profile else None)
            length = args.context + WARMUP_STEPS + args.steps + 2 * PROFILE_STEPS
            cache, res = None, None
            try:
                cache = make_cache(name, model, length)
                res = run(model, cache, ids, args.steps, chunk, profile_to)
                if name == "wave":
                    res["exact_fraction"] = cache.decode_stats.exact_fraction
                tokens = length if name == "static" else (args.context + WARMUP_STEPS
                                                          + args.steps // 2)
                res["kv_read_gb"] = kv_read_gb(model.config, name, batch, tokens, res)
                res["kv_read_gbs"] = res["kv_read_gb"] / res["step_ms"] * 1e3
            except Exception as exc:  # report and carry on with the other variants
                oom = _is_oom(exc)
                print(f"{name} batch {batch}: {'oom' if oom else ''} {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)
                row[f"{name}_error"] = "oom" if oom else f"{type(exc).__name__}: {str(exc)[:200]}"
            finally:  # free the failed (or finished) variant's memory before the next one
                if name == "wave" and cache is not None:
                    cache.close()
                cache = None
                gc.collect()
                torch.cuda.empty_cache()
            if res is not None:
                row.update({f"{name}_{k}": v for k, v in res.items()})
                print(name, batch, res, flush=True)
            best = max((row[f"{b}_tokens_per_s"] for b in BASELINES
                        if f"{b}_tokens_per_s" in row), default=None)
            if best is not None and "wave_tokens_per_s" in row:
                row["speedup"] = row["wave_tokens_per_s"] / best
            save(args, rows, ceil)  # after every cache: a run stopped early keeps what it measured
        del ids
    print("\n" + (args.out / "e2e.md").read_text(), flush=True)


def save(args: argparse.Namespace, rows: list[dict], ceil: dict[str, float]) -> None:
    """Write ``e2e.{json,md,png}`` of the batches measured so far."""
    import transformers

    meta = {**machine(), **ceil, "transformers": transformers.__version__,
            "model": "Llama-3-8B shape, random weights, bf16", "steps": args.steps,
            "warmup_steps": WARMUP_STEPS, "layers": args.layers,
            "prefill_chunk": args.prefill_chunk, "largest": largest(rows)}
    write(args.out, meta, rows)


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    """``e2e.json`` (``meta`` + ``rows``), ``e2e.md`` (their table, then the largest batch
    each cache ran) and ``e2e.png`` under ``out``."""
    write_results(out, "e2e", meta, rows, COLUMNS, "End-to-end decode tokens/s")
    top = meta["largest"]
    if top:
        md = out / "e2e.md"
        md.write_text(md.read_text() + "\nLargest batch each cache ran: " + ", ".join(
            f"{name} {top[name]['batch']} ({top[name]['tokens_per_s']:.1f} tokens/s"
            + (f", out of memory at {top[name]['oom_at']})" if top[name]["oom_at"] else ")")
            for name in CACHES if name in top)
            + (f"; wave / best baseline {top['speedup']:.2f}x" if "speedup" in top else "")
            + ".\n")
    plot(rows, top, out / "e2e.png")


if __name__ == "__main__":
    main()
