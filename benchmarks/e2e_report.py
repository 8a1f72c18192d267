"""``benchmarks/e2e.py``'s results: one row per (batch, cache), ratios against ``full``.

The rule (``../shared/BENCHMARKS.md``): the baseline is the fastest way a user could run
the same job, here full attention as serving engines run it (``full``). Every ratio
divides by the ``full`` row of the same batch, context and layers (``vs_full``: tokens/s
over ``full``'s; ``prefill_vs_full``: prefill time over ``full``'s), and
:func:`largest` divides each cache at the largest batch it ran by ``full`` at the largest
batch it ran. transformers' ``DynamicCache`` and ``StaticCache`` (``dynamic``,
``static``) are reported as "transformers' defaults", with their own ratio to ``full``,
never as a baseline.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import plot_pairs, write_results

__all__ = ["BASELINE", "CACHES", "LABELS", "COLUMNS", "kv_read_gb", "with_ratios", "largest",
           "write"]

BASELINE = "full"
CACHES = ("full", "wave", "wave-pinned", "dynamic", "static")
LABELS = {
    "full": "full attention (flash, KV in place, CUDA graph)",
    "wave": "vecstore wave cache",
    "wave-pinned": "vecstore wave cache, KV in pinned host memory",
    "dynamic": "DynamicCache + SDPA (transformers' default)",
    "static": "StaticCache + SDPA (transformers' default)",
}
COLUMNS = ["batch", "context", "layers", "cache", "tokens_per_s", "vs_full", "step_ms",
           "gpu_ms", "wall_over_gpu", "kv_read_gbs", "prefill_s", "prefill_vs_full",
           "prefill_gpu_s", "first_step_s",
           "peak_gpu_gb", "exact_fraction", "cache_capacity", "hit_rate", "vs_resident",
           "num_splits", "prefill_chunk", "error"]


def _key(row: dict) -> tuple:
    return row["batch"], row["context"], row["layers"]


def kv_read_gb(config, name: str, batch: int, tokens: int, res: dict) -> float:
    """KV bytes (GB) the attention of ``name`` reads per decode step over all layers, for
    ``batch`` rows of ``tokens`` tokens (``StaticCache``: ``tokens`` is its preallocated
    length; the wave caches: only the rows they read exactly, ``res["exact_fraction"]``)."""
    per_token = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16
    whole = config.num_hidden_layers * batch * tokens * per_token / 1e9
    return whole * res["exact_fraction"] if name.startswith("wave") else whole


def with_ratios(rows: list[dict]) -> list[dict]:
    """``rows`` with ``vs_full`` and ``prefill_vs_full`` set where the ``full`` row of the
    same batch, context and layers ran, ``vs_resident`` on ``wave-pinned`` rows where the
    resident ``wave`` row of the same batch ran (tokens/s over its), and
    ``wall_over_gpu`` where the device time is
    known (the step's wall time over its busy device time: > 1 is time the device waited
    for the host)."""
    full = {_key(r): r for r in rows if r["cache"] == BASELINE and "tokens_per_s" in r}
    resident = {_key(r): r for r in rows if r["cache"] == "wave" and "tokens_per_s" in r}
    out = []
    for r in rows:
        r = dict(r)
        base = full.get(_key(r))
        if base is not None and "tokens_per_s" in r:
            r["vs_full"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["prefill_vs_full"] = r["prefill_s"] / base["prefill_s"]
        wave = resident.get(_key(r))
        if r["cache"] == "wave-pinned" and wave is not None and "tokens_per_s" in r:
            r["vs_resident"] = r["tokens_per_s"] / wave["tokens_per_s"]
        if r.get("gpu_ms"):
            r["wall_over_gpu"] = r["step_ms"] / r["gpu_ms"]
        out.append(r)
    return out


def largest(rows: list[dict]) -> dict:
    """Per cache, the largest batch it ran, its tokens/s and the smallest batch that ran
    out of memory (``None`` if none did); for each cache but ``full``, ``vs_full``: its
    tokens/s at its largest batch over ``full``'s at ``full``'s largest batch."""
    out: dict = {}
    for name in CACHES:
        ran = [r for r in rows if r["cache"] == name and "tokens_per_s" in r]
        if not ran:
            continue
        top = max(ran, key=lambda r: r["batch"])
        oom = [r["batch"] for r in rows if r["cache"] == name and r.get("error") == "oom"]
        out[name] = {"batch": top["batch"], "tokens_per_s": top["tokens_per_s"],
                     "oom_at": min(oom, default=None)}
    if BASELINE in out:
        for name, top in out.items():
            if name != BASELINE:
                top["vs_full"] = top["tokens_per_s"] / out[BASELINE]["tokens_per_s"]
    return out


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    """``e2e.json`` (``meta`` + ``rows``), ``e2e.md`` (their table, then the largest batch
    each cache ran) and ``e2e.png`` under ``out``."""
    write_results(out, "e2e", meta, rows, COLUMNS, "End-to-end decode tokens/s")
    top = meta["largest"]
    notes = ["", "Ratios divide by `full` (full attention as serving engines run it) at the "
             "same batch; `dynamic` and `static` are transformers' defaults, reported, never "
             "a baseline. `wall_over_gpu`: the decode step's wall time over the time the GPU "
             "was busy in it (profiler): near 1 the step is device-bound."]
    if top:
        notes.append("")
        notes.append("Largest batch each cache ran: " + "; ".join(
            f"{name} {t['batch']} ({t['tokens_per_s']:.1f} tokens/s"
            + (f", {t['vs_full']:.2f}x full at its largest" if "vs_full" in t else "")
            + (f", out of memory at {t['oom_at']}" if t["oom_at"] else "") + ")"
            for name, t in top.items()) + ".")
    md = out / "e2e.md"
    md.write_text(md.read_text() + "\n".join(notes) + "\n")
    plot(rows, top, out / "e2e.png")


def plot(rows: list[dict], top: dict, path: Path) -> None:
    """Decode tokens/s of every cache per batch (a cache that did not run at a batch shows
    no bar there), then each cache at the largest batch it ran (``top``)."""
    batches = sorted({r["batch"] for r in rows if "tokens_per_s" in r})
    names = [n for n in CACHES if n in top]
    if not batches or not names:
        return
    rate = {(r["batch"], r["cache"]): r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    labels = [f"batch {b}" for b in batches] + ["largest batch each\n" + ", ".join(
        f"{n} {top[n]['batch']}" for n in names)]
    series = {LABELS[n]: [rate.get((b, n), 0.0) for b in batches] + [top[n]["tokens_per_s"]]
              for n in names}
    plot_pairs(path, labels, series, "decode tokens/s",
               f"end to end, {rows[0]['context'] // 1024}K context, {rows[0]['layers']} layers")
