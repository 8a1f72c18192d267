"""Relative error of ``seq.query`` vs exact attention, per index kind, at default budgets.

Two kinds of keys: i.i.d. Gaussian (no structure: the hardest case for any sparse method)
and a Gaussian mixture (structure like real keys), with queries drawn near stored keys.
Writes ``benchmarks/results/query_error.{json,md}``.

    python benchmarks/query_error.py [--tokens 32768] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from vecstore import Store
from vecstore.index import INDEXES

RESULTS = Path(__file__).parent / "results"


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g = q.shape[0] // k.shape[0]
    logits = (q.double() @ k.double().repeat_interleave(g, 0).transpose(1, 2)) / q.shape[-1] ** 0.5
    return torch.softmax(logits, -1) @ v.double().repeat_interleave(g, 0)


def make_data(kind: str, heads: int, tokens: int, dim: int, gen: torch.Generator):
    if kind == "random":
        keys = torch.randn(heads, tokens, dim, generator=gen)
    else:
        centers = 2.0 * torch.randn(heads, tokens // 64, dim, generator=gen)
        pick = torch.randint(0, centers.shape[1], (heads, tokens), generator=gen)
        keys = torch.gather(centers, 1, pick[..., None].expand(-1, -1, dim))
        keys = keys + 0.5 * torch.randn(heads, tokens, dim, generator=gen)
    values = torch.randn(heads, tokens, dim, generator=gen)
    return keys, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    heads, group, dim = 8, 4, 128
    rows = []
    for data in ("random", "mixture"):
        for kind in INDEXES.names():
            errs, exact_frac, mass = [], [], []
            for seed in range(args.seeds):
                gen = torch.Generator().manual_seed(seed)
                keys, values = make_data(data, heads, args.tokens, dim, gen)
                pos = torch.randint(0, args.tokens, (heads * group,), generator=gen)
                q = keys[torch.arange(heads * group) // group, pos][:, None]
                q = q + 0.5 * torch.randn(q.shape, generator=gen)
                with Store.open(config={"index": {"kind": kind}}) as store:
                    seq = store.create("s", num_layers=1, num_kv_heads=heads, head_dim=dim,
                                       dtype=torch.float32)
                    seq.append(0, keys, values)
                    res = seq.query(0, q)
                ref = exact(q, keys, values)
                errs.append(float((res.out.double() - ref).norm() / ref.norm()))
                exact_frac.append(res.stats.exact_fraction)
                mass.append(res.stats.estimated_mass)
            rows.append({"data": data, "index": kind, "rel_error": sum(errs) / len(errs),
                         "exact_fraction": sum(exact_frac) / len(exact_frac),
                         "estimated_mass": sum(mass) / len(mass)})
            print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "torch": torch.__version__, "tokens": args.tokens, "seeds": args.seeds,
            "shape": {"kv_heads": heads, "q_heads": heads * group, "head_dim": dim},
            "config": "defaults (retrieval 0.018, estimation 0.232, 16 tokens/cluster)"}
    (RESULTS / "query_error.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| keys | index | relative L2 error | tokens read exactly | estimated mass |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['data']} | {r['index']} | {r['rel_error']:.3f} | "
              f"{100 * r['exact_fraction']:.1f}% | {r['estimated_mass']:.3f} |" for r in rows]
    (RESULTS / "query_error.md").write_text(
        f"Relative error of seq.query vs exact attention ({args.tokens} tokens, 8 KV heads x "
        f"4 query heads, d=128, {args.seeds} seeds, default budgets; {meta['date']}, "
        f"{meta['machine']}).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
