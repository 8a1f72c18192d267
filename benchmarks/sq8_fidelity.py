"""Does scoring int8 centroid codes (the wave executor's default) cost accuracy on a real model?

SmolLM2-135M-Instruct prefills RULER-style prompts exactly; the queries of each prompt's last
tokens are answered by a ``wave`` store at every layer (``benchmarks.accuracy.fidelity``)
twice: with the index's float32 centroids, and with each centroid replaced by what its SQ8
codes stand for (:mod:`vecstore.executor.sq8`) — what the wave executor ranks and estimates
with, as its tests check against the torch reference on dequantized centroids. Reported per
prompt: the mean over layers of the relative L2 error against exact float64 attention, and of
the captured softmax mass. CPU only.

    python benchmarks/sq8_fidelity.py [--length 6000] [--queries 16]
"""

from __future__ import annotations

import argparse
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.accuracy.fidelity import capture, layer_fidelity  # noqa: E402
from benchmarks.common import RESULTS, machine, write_results  # noqa: E402
from integrations.hf.model_loading import load_smollm2  # noqa: E402
from integrations.tasks import make_sample  # noqa: E402
from vecstore.executor.sq8 import dequantize, quantize  # noqa: E402
from vecstore.index.wave import WaveIndex  # noqa: E402

PROMPTS = [("niah_multikey", 3), ("variable_tracking", 3), ("passkey", 4)]


@contextmanager
def sq8_centroids() -> Iterator[None]:
    """Wave indexes built in the block keep each centroid as its SQ8 codes stand for it."""
    build = WaveIndex.build

    def quantized_build(self, keys, values, start):
        segments = build(self, keys, values, start)
        for seg in segments:
            seg.meta["centroids"].copy_(dequantize(*quantize(seg.meta["centroids"])))
        return segments

    WaveIndex.build = quantized_build
    try:
        yield
    finally:
        WaveIndex.build = build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=6000, help="prompt tokens")
    parser.add_argument("--queries", type=int, default=16, help="decode queries per prompt")
    parser.add_argument("--budget", type=float, default=0.018, help="retrieval budget")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    rows = []
    for task, seed in PROMPTS:
        captured = capture(model, tokenizer, make_sample(task, args.length, seed, tokenizer),
                           args.queries)
        for centroids in ("float32", "sq8"):
            if centroids == "sq8":
                with sq8_centroids():
                    fid = layer_fidelity(captured, "wave", args.budget, task=task, model=model)
            else:
                fid = layer_fidelity(captured, "wave", args.budget, task=task, model=model)
            rows.append({"task": task, "seed": seed, "centroids": centroids,
                         "rel_error": sum(f.rel_error for f in fid) / len(fid),
                         "worst_layer_error": max(f.rel_error for f in fid),
                         "captured_mass": sum(f.captured_mass for f in fid) / len(fid),
                         "layers": len(fid)})
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            print(rows[-1], f"peak RSS {peak:.1f} GB", flush=True)
    meta = {**machine(), "model": "SmolLM2-135M-Instruct", "length": args.length,
            "queries": args.queries, "retrieval_budget": args.budget}
    write_results(args.out, "sq8_fidelity", meta, rows,
                  ["task", "seed", "centroids", "rel_error", "worst_layer_error",
                   "captured_mass", "layers"],
                  "Wave attention with float32 centroids and with their SQ8 codes")


if __name__ == "__main__":
    main()
