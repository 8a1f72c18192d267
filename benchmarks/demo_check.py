"""Check the demo's decode speeds against a plain timing of ``model.generate``.

``vecstore demo`` reports a steady decode rate taken between the timestamps of the
generated tokens (:func:`integrations.demo.answer`). This script measures the same
thing without the demo's machinery: per cache (transformers' ``StaticCache`` and the wave
cache), it times whole ``model.generate`` calls on the demo's prompt that are forced to
make ``short`` and ``long`` new tokens, and takes the decode rate as the extra tokens over
the extra time (prefill, setup and first step cancel out). Each call gets a fresh cache;
each length runs ``--repeats`` times and the fastest counts. The demo's own figure is
measured in the same process, right before. The extra steps must outweigh the calls'
spread: the wave cache's first decode step indexes the prompt (~10 s at 7K tokens on two
cores, varying by seconds), so ``--long`` is 200 by default.

Usage::

    python benchmarks/demo_check.py [--tokens 7000] [--short 2] [--long 200] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine  # noqa: E402
from integrations.demo import answer, warm_up  # noqa: E402
from integrations.hf.cache import WaveCache  # noqa: E402
from integrations.hf.cache_arg import cache_arg  # noqa: E402
from integrations.hf.model_loading import load_smollm2  # noqa: E402
from integrations.tasks import make_sample  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _cache(kind: str, model, length: int):
    from transformers import StaticCache

    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return WaveCache(None, model)


@torch.no_grad()
def generate_seconds(model, ids: torch.Tensor, kind: str, new: int, pad: int) -> float:
    """Wall seconds of one ``model.generate`` call making exactly ``new`` tokens."""
    cache = _cache(kind, model, ids.shape[1] + new)
    try:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad,
                             **cache_arg(model, cache))
        seconds = time.perf_counter() - start
    finally:
        if kind == "wave":
            cache.close()
    assert out.shape[1] == ids.shape[1] + new
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=7000)
    p.add_argument("--short", type=int, default=2)
    p.add_argument("--long", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    model, tokenizer = load_smollm2(device=torch.device("cpu"))
    warm_up()
    sample = make_sample("passkey", args.tokens, 0, tokenizer)
    ids = tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    pad = tokenizer.eos_token_id
    rows = []
    for kind in ("static", "wave"):
        cache = _cache(kind, model, ids.shape[1] + sample.max_new_tokens)
        demo = answer(model, tokenizer, ids, cache, max_new_tokens=sample.max_new_tokens,
                      desc=kind, quiet=True)
        if kind == "wave":
            cache.close()
        times = {n: min(generate_seconds(model, ids, kind, n, pad) for _ in range(args.repeats))
                 for n in (args.short, args.long)}
        plain = (args.long - args.short) / (times[args.long] - times[args.short])
        rows.append({"cache": kind, "demo_tokens_per_s": demo.tokens_per_second,
                     "demo_timed_steps": demo.new_tokens - 2, "plain_tokens_per_s": plain,
                     "demo_over_plain": demo.tokens_per_second / plain,
                     "generate_s": {str(n): t for n, t in times.items()}})
        print(rows[-1], flush=True)
    meta = {"prompt_tokens": ids.shape[1], "torch_threads": torch.get_num_threads(),
            **machine(), **vars(args), "out": str(args.out)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# The demo's decode speeds against plain `model.generate` timings", "",
             f"SmolLM2-135M-Instruct on the CPU ({meta['torch_threads']} threads), prompt of "
             f"{meta['prompt_tokens']} tokens; plain rate = ({args.long} - {args.short}) tokens "
             f"over the difference of the fastest of {args.repeats} `generate` calls each.", "",
             "| cache | demo tokens/s | plain generate tokens/s | demo / plain |",
             "|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['demo_tokens_per_s']:.2f} | {r['plain_tokens_per_s']:.2f} "
              f"| {r['demo_over_plain']:.2f} |" for r in rows]
    (args.out / "demo_check.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
