"""Command line of the accuracy harness: ``python -m benchmarks.accuracy [options]``.

Fidelity runs first, then the tasks from the longest length down, so that an interrupted
run has the numbers that matter most. Fidelity records go to ``<out>/<name>.fidelity.jsonl``
and every answered sample is appended to ``<out>/<name>.runs.jsonl``; ``--resume`` reuses
both (e.g. to add seeds) and answers only what is missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import tomllib
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.accuracy.fidelity import run_fidelity
from benchmarks.accuracy.harness import METHODS, plan_runs, run_sample
from benchmarks.accuracy.report import environment, markdown, summarize, write
from integrations.hf.model_loading import load_smollm2
from integrations.tasks import TASKS, make_sample

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Options of the harness, with the defaults of the committed run."""
    p = argparse.ArgumentParser(prog="accuracy", description=(
        "RULER-style tasks and attention fidelity of vecstore's methods on "
        "SmolLM2-135M-Instruct."))
    p.add_argument("--lengths", type=int, nargs="+", default=[8000, 4096, 2048],
                   help="prompt lengths in tokens (8000 leaves room for answers in 8192)")
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 1, 1],
                   help="samples per task: one count for every length, or one per length")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--budget", type=float, default=0.018,
                   help="retrieval budget of every sparse method (the default 1.8%%)")
    p.add_argument("--sweep-budgets", type=float, nargs="*",
                   default=[0.005, 0.036, 0.072])
    p.add_argument("--sweep-methods", nargs="*", default=["wave", "wave_noest", "quest",
                                                            "sink_window", "topk_oracle"])
    p.add_argument("--sweep-length", type=int, default=8000)
    p.add_argument("--sweep-tasks", nargs="*",
                   default=["passkey", "niah_multikey", "variable_tracking"])
    p.add_argument("--fidelity-tasks", nargs="*", default=["niah_multikey", "variable_tracking"])
    p.add_argument("--fidelity-length", type=int, default=6000)
    p.add_argument("--fidelity-queries", type=int, default=16)
    p.add_argument("--config", type=Path, default=None,
                   help="TOML of further store settings for every sparse method (its index "
                        "kind and budgets still come from the method)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="accuracy")
    p.add_argument("--resume", action="store_true", help="skip samples already answered")
    return p


def _load_done(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    """Run the harness; returns 0 (results are written to ``--out``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.seeds) not in (1, len(args.lengths)):
        parser.error(f"--seeds: give 1 count or {len(args.lengths)} (one per length)")
    seeds = dict(zip(args.lengths, args.seeds * len(args.lengths)
                     if len(args.seeds) == 1 else args.seeds, strict=True))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    start = time.perf_counter()
    model, tokenizer = load_smollm2(device=args.device)
    methods = [m for m in args.methods if m != "full"]
    base = None
    if args.config is not None:
        with args.config.open("rb") as fh:
            base = tomllib.load(fh)

    args.out.mkdir(parents=True, exist_ok=True)
    fidelity_path = args.out / f"{args.name}.fidelity.jsonl"
    fidelity = _load_done(fidelity_path) if args.resume else []
    wanted = {(t, m) for t in args.fidelity_tasks for m in ["full", *methods]}
    if {(r["task"], r["method"]) for r in fidelity} != wanted:
        fidelity_samples = [make_sample(t, args.fidelity_length, 0, tokenizer)
                            for t in args.fidelity_tasks]
        fidelity = [f.to_dict() for f in tqdm(
            run_fidelity(model, tokenizer, fidelity_samples, ["full", *methods], args.budget,
                         num_queries=args.fidelity_queries, base=base),
            desc="fidelity", unit="layer", total=len(fidelity_samples) * (len(methods) + 1)
            * model.config.num_hidden_layers)]
        fidelity_path.write_text("".join(json.dumps(f) + "\n" for f in fidelity))

    runs_path = args.out / f"{args.name}.runs.jsonl"
    results = _load_done(runs_path) if args.resume else []
    if not args.resume:
        runs_path.write_text("")
    done = {(r["task"], r["length"], r["seed"], r["method"], r["budget"]) for r in results}
    plan = [(length, task, seed) for length in sorted(args.lengths, reverse=True)
            for seed in range(seeds[length]) for task in args.tasks]
    for length, task, seed in tqdm(plan, desc="samples", unit="sample"):
        swept = length == args.sweep_length and task in args.sweep_tasks and seed == 0
        runs = [r for r in plan_runs(args.methods, args.budget, args.sweep_methods,
                                     args.sweep_budgets, swept=swept)
                if (task, length, seed, *r) not in done]
        if not runs:
            continue
        sample = make_sample(task, length, seed, tokenizer)
        for result in run_sample(model, tokenizer, sample, runs, base=base):
            results.append(result.to_dict())
            with runs_path.open("a") as fh:
                fh.write(json.dumps(result.to_dict()) + "\n")
            log.info("%s %d #%d %s@%s: %.2f %r", task, length, seed, result.method,
                     result.budget, result.score, result.answer[:60])

    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings["store_config"] = base
    settings["seconds"] = round(time.perf_counter() - start)
    previous = args.out / f"{args.name}.json"
    settings["seconds_total"] = settings["seconds"] + (
        json.loads(previous.read_text())["settings"].get("seconds_total", 0)
        if args.resume and previous.is_file() else 0)
    summary = summarize(results, fidelity, args.budget, args.sweep_length)
    meta = environment(args.device, threads)
    paths = write(args.out, args.name, {"meta": meta, "settings": settings, "summary": summary,
                                        "results": results, "fidelity": fidelity})
    print(markdown(summary, meta, settings))
    print("wrote", ", ".join(str(p) for p in paths))
    return 0
