"""The decode step's projections and greedy pick: separate against fused, on one GPU.

A decoder layer's query, key and value projections read the same hidden states, as do the
MLP's gate and up projections; serving engines store each set as one matrix and run one
GEMM. At decode a GEMM reads its weights once for a few tokens, so its time is the
weights' bytes over the bandwidth it reaches. Per batch size this times, as device time
(:class:`benchmarks.common.Timer`, L2 flushed), Llama-3-8B's shapes in bfloat16:

- ``qkv``: three ``F.linear`` against one over the concatenated weights;
- ``gate_up``: two against one;
- ``argmax``: the greedy pick over the vocabulary's logits, ``argmax(-1)`` against a
  two-stage pick (:func:`benchmarks.e2e_models.greedy`: the maxima of 256-wide chunks,
  then of those), as ``e2e.py``'s steps pick.

    python benchmarks/projections.py --batches 4 8 24 --out DIR

Writes ``projections.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, Timer, machine, print_row, write_results  # noqa: E402
from benchmarks.e2e_models import MODELS, greedy  # noqa: E402

HIDDEN, HEADS, KV_HEADS, DIM, INTER, VOCAB = MODELS["llama-3-8b"]


def _ops(x: torch.Tensor, logits: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
         wv: torch.Tensor, wqkv: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor,
         wgu: torch.Tensor) -> dict[str, Callable[[], object]]:
    sizes = [wq.shape[0], wk.shape[0], wv.shape[0]]
    return {
        "qkv_separate": lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)),
        "qkv_fused": lambda: F.linear(x, wqkv).split(sizes, -1),
        "gate_up_separate": lambda: (F.linear(x, wg), F.linear(x, wu)),
        "gate_up_fused": lambda: F.linear(x, wgu).chunk(2, -1),
        "argmax": lambda: logits.argmax(-1),
        "argmax_two_stage": lambda: greedy(logits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 24])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    dev = torch.device("cuda")
    timer = Timer(dev)
    bf = {"dtype": torch.bfloat16, "device": dev}
    wq = torch.randn(HEADS * DIM, HIDDEN, **bf)
    wk = torch.randn(KV_HEADS * DIM, HIDDEN, **bf)
    wv = torch.randn(KV_HEADS * DIM, HIDDEN, **bf)
    wqkv = torch.cat([wq, wk, wv])
    wg, wu = torch.randn(INTER, HIDDEN, **bf), torch.randn(INTER, HIDDEN, **bf)
    wgu = torch.cat([wg, wu])
    rows = []
    for batch in args.batches:
        x = torch.randn(batch, HIDDEN, **bf)
        logits = torch.randn(batch, VOCAB, device=dev)
        assert torch.equal(greedy(logits)[:, 0], logits.argmax(-1))
        fns = _ops(x, logits, wq, wk, wv, wqkv, wg, wu, wgu)
        ms = timer.times(fns, args.reps, device_only=tuple(fns))
        for name, t in ms.items():
            row = {"batch": batch, "op": name, "us": round(t * 1e3, 2)}
            rows.append(row)
            print_row(row)
    write_results(args.out, "projections", machine(), rows, ["batch", "op", "us"],
                  "Decode projections and greedy pick, separate against fused (device us, "
                  "median, L2 flushed; Llama-3-8B shapes, bfloat16 weights, float32 logits)")


if __name__ == "__main__":
    main()
