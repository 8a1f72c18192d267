"""Check the decode step's kernels against float64 references, then time each beside its torch
reference.

Needs a CUDA device. Llama-3-8B attention shape (32 query heads, 8 KV heads, head dim 128,
bf16 KV, int8 centroid codes as the wave executor scores by default), 16 tokens per cluster,
the default budgets (retrieval 1.8%, estimation 23.2% of clusters, steady zone 4 + 64 tokens).
Each kernel of :mod:`vecstore.kernels` runs with the launch parameters the wave executor uses
(the same launch wrappers); the torch side is :mod:`vecstore.kernels.reference` and the
index's ranking. Per kernel, batch and context both are timed interleaved (A B A B ...), the
median of ``triton.testing`` runs replayed from a CUDA graph. The whole step is timed by
``benchmarks/decode.py``.

Usage::

    python benchmarks/kernel_speed.py --out benchmarks/results/kernels-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vecstore.executor.sq8 import dequantize, quantize  # noqa: E402
from vecstore.index.pages import group_softmax_rank  # noqa: E402
from vecstore.index.wave import bound_logits  # noqa: E402
from vecstore.kernels.centroid_logits import Logits, centroid_logits  # noqa: E402
from vecstore.kernels.estimated_attention import attend_estimated, estimate_layout  # noqa: E402
from vecstore.kernels.merge_parts import combine  # noqa: E402
from vecstore.kernels.reference import attend, estimate, merge  # noqa: E402
from vecstore.kernels.retrieved_attention import (  # noqa: E402
    attend_retrieved,
    fill_rowmap,
    retrieved_layout,
)
from vecstore.kernels.steady_attention import attend_steady, steady_splits  # noqa: E402
from vecstore.kernels.zone_select import select_ranked  # noqa: E402
from vecstore.kernels.zones import Zones  # noqa: E402

HQ, HKV, D, TOKENS_PER_CLUSTER = 32, 8, 128, 16
G = HQ // HKV
RETRIEVAL, ESTIMATION, STEADY, RADIUS_WEIGHT = 0.018, 0.232, 4 + 64, 0.5
SCALE = D**-0.5
DEVICE = "cuda"
TOLERANCE = 1e-2  # relative L2 error allowed for bf16 inputs
KERNELS = ("centroid_logits", "select_ranked", "attend_retrieved", "attend_steady",
           "attend_estimated", "combine")


class Step:
    """The inputs and outputs of one decode step over ``batch`` sequences of ``tokens``."""

    def __init__(self, batch: int, tokens: int, gen: torch.Generator) -> None:
        dev, bf16 = DEVICE, torch.bfloat16
        self.rows, self.clusters = batch * HKV, tokens // TOKENS_PER_CLUSTER
        rows, clusters = self.rows, self.clusters
        self.q = torch.randn(rows * G, D, device=dev, generator=gen).to(bf16)
        centroids = torch.randn(rows, clusters, D, device=dev, generator=gen)
        self.codes, self.code_scales = quantize(centroids)
        self.radii = torch.rand(rows, clusters, device=dev, generator=gen)
        self.sizes = torch.full((rows, clusters), TOKENS_PER_CLUSTER, device=dev,
                                dtype=torch.int32)
        self.first = (torch.arange(clusters, device=dev, dtype=torch.int32)
                      * TOKENS_PER_CLUSTER).expand(rows, -1).contiguous()
        r_max = math.ceil(RETRIEVAL * clusters)
        e_max = math.ceil(ESTIMATION * clusters)
        self.k1 = torch.full((rows,), r_max, device=dev, dtype=torch.int32)
        self.k2 = self.k1 + e_max
        self.keys = torch.randn(rows, tokens, D, device=dev, generator=gen).to(bf16)
        self.values = torch.randn(rows, tokens, D, device=dev, generator=gen).to(bf16)
        self.steady_k = torch.randn(batch, HKV, STEADY, D, device=dev, generator=gen).to(bf16)
        self.steady_v = torch.randn(batch, HKV, STEADY, D, device=dev, generator=gen).to(bf16)
        self.steady_len = torch.full((batch,), STEADY, device=dev)
        self.vmean = torch.randn(rows, clusters, D, device=dev, generator=gen).to(bf16)
        self.weights = torch.empty(rows * G, clusters, device=dev)
        self.zones = Zones.empty(rows, clusters, r_max, torch.device(dev), e_max)
        self.max_rows = r_max * TOKENS_PER_CLUSTER
        self.rowmap = torch.empty(rows, self.max_rows, device=dev, dtype=torch.int32)
        self.n_ret = retrieved_layout(self.max_rows)[1]
        self.n_std = steady_splits(STEADY)
        num_parts = self.n_ret + self.n_std + estimate_layout(e_max)[1]
        self.parts = (torch.empty(rows * G, num_parts, D, device=dev),
                      torch.empty(rows * G, num_parts, device=dev))
        self.out = torch.empty(rows * G, D, device=dev, dtype=bf16)
        self.lse = torch.empty(rows * G, device=dev)
        self.logits = self.run_logits()
        select_ranked(self.logits, self.sizes, self.first, self.k1, self.k2, self.zones)
        fill_rowmap(self.zones, self.rowmap)

    def run_logits(self) -> Logits:
        return centroid_logits(self.q, self.codes, self.radii, self.sizes, SCALE, RADIUS_WEIGHT,
                               self.weights, self.code_scales)

    def triton_calls(self) -> dict[str, Callable[[], object]]:
        """One zero-argument launch per kernel, as the wave executor launches it."""
        z, parts = self.zones, self.parts
        return {
            "centroid_logits": self.run_logits,
            "select_ranked": lambda: select_ranked(self.logits, self.sizes, self.first, self.k1,
                                                   self.k2, z),
            "attend_retrieved": lambda: attend_retrieved(self.q, self.keys, self.values, z,
                                                         self.rowmap, SCALE, parts, 0),
            "attend_steady": lambda: attend_steady(self.q, self.steady_k, self.steady_v,
                                                   self.steady_len, SCALE, parts, self.n_ret),
            "attend_estimated": lambda: attend_estimated(self.weights, self.vmean, z, parts,
                                                         self.n_ret + self.n_std),
            "combine": lambda: combine(parts, self.out, self.lse),
        }

    def grouped(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The queries ``[rows, 1, G, 1, D]`` as the references take them."""
        return self.q.to(dtype).view(self.rows, 1, G, 1, D)

    def retrieved_mask(self) -> torch.Tensor:
        """``[rows, 1, tokens]`` bool: the rows of each row's retrieved clusters."""
        hit = (self.zones.zone == 1).repeat_interleave(TOKENS_PER_CLUSTER, dim=1)
        return hit[:, None]

    def torch_calls(self) -> dict[str, Callable[[], object]]:
        """The torch reference of each kernel on the same inputs (float32)."""
        dq = dequantize(self.codes, self.code_scales)[None]
        est = self.zones.est_ids.long().clamp_min(0)
        gather = est[..., None].expand(-1, -1, D)
        log_n = self.sizes.gather(1, est).float().log()[:, None]
        kv = (self.keys[:, None], self.values[:, None])
        k2 = int(self.k2[0])  # read here: a capture cannot copy to the host
        return {
            "centroid_logits": lambda: bound_logits(self.grouped()[None, :, 0], dq,
                                                    self.radii[None], SCALE, RADIUS_WEIGHT),
            "select_ranked": lambda: torch.topk(group_softmax_rank(
                self.logits.rank.view(1, self.rows, G, 1, -1), self.sizes[None]), k2),
            "attend_retrieved": lambda: attend(self.grouped(), *kv, self.retrieved_mask(),
                                               SCALE),
            "attend_steady": lambda: attend(self.grouped(), self.steady_k.flatten(0, 1)[:, None],
                                            self.steady_v.flatten(0, 1)[:, None],
                                            torch.ones(self.rows, 1, STEADY, dtype=torch.bool,
                                                       device=DEVICE), SCALE),
            "attend_estimated": lambda: estimate(self.grouped(), dq[0].gather(1, gather)[:, None],
                                                 log_n, self.vmean.gather(1, gather)[:, None],
                                                 SCALE),
            "combine": lambda: merge_parts(self.parts, 0, self.parts[1].shape[1]),
        }


def merge_parts(parts: tuple[torch.Tensor, torch.Tensor], lo: int,
                hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference merge of the partial states ``lo:hi`` of every query row, in their
    dtype: ``out [rows, D]``, ``lse [rows]``."""
    out, lse = torch.zeros_like(parts[0][:, 0]), torch.full_like(parts[1][:, 0], float("-inf"))
    for p in range(lo, hi):
        out, lse = merge(out, lse, parts[0][:, p], parts[1][:, p])
    return out, lse


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error in float64 (``inf`` if ``x`` holds NaN)."""
    if torch.isnan(x).any():
        return math.inf
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def check_all(gen: torch.Generator) -> dict[str, float]:
    """Relative L2 errors of the kernels against float64 on a small Llama-shaped step."""
    s = Step(2, 32768, gen)
    for call in s.triton_calls().values():
        call()
    q64 = s.grouped(torch.float64)
    dq = dequantize(s.codes, s.code_scales).double()[None]
    rank = bound_logits(q64[None, :, 0], dq, s.radii.double()[None], SCALE, RADIUS_WEIGHT)
    errors = {"centroid_logits.rank": rel_l2(s.logits.rank, rank.reshape(s.rows * G, -1))}
    score = group_softmax_rank(rank, s.sizes[None])[0]
    chosen = score.gather(1, s.zones.ids.long()).sum(1)
    best = score.topk(int(s.k1[0]), dim=1).values.sum(1)
    errors["select_ranked.retrieved_score"] = float((1 - chosen / best).abs().max())
    rows = [("attend_retrieved", attend(q64, s.keys.double()[:, None], s.values.double()[:, None],
                                        s.retrieved_mask(), SCALE), 0, s.n_ret)]
    rows.append(("attend_steady", attend(q64, s.steady_k.double().flatten(0, 1)[:, None],
                                         s.steady_v.double().flatten(0, 1)[:, None],
                                         torch.ones(s.rows, 1, STEADY, dtype=torch.bool,
                                                    device=DEVICE), SCALE),
                 s.n_ret, s.n_ret + s.n_std))
    est = s.zones.est_ids.long()
    gather = est[..., None].expand(-1, -1, D)
    rows.append(("attend_estimated", estimate(q64, dq[0].gather(1, gather)[:, None],
                                              s.sizes.gather(1, est).double().log()[:, None],
                                              s.vmean.double().gather(1, gather)[:, None], SCALE),
                 s.n_ret + s.n_std, s.parts[1].shape[1]))
    total = None
    parts64 = (s.parts[0].double(), s.parts[1].double())
    for name, (ref_out, ref_lse), lo, hi in rows:
        out, lse = merge_parts(parts64, lo, hi)
        errors[f"{name}.out"] = rel_l2(out, ref_out.reshape(out.shape))
        errors[f"{name}.lse"] = rel_l2(lse, ref_lse.reshape(lse.shape))
        total = (out, lse) if total is None else merge(*total, out, lse)
    assert total is not None
    errors["combine.out"] = rel_l2(s.out, total[0])
    errors["combine.lse"] = rel_l2(s.lse, total[1])
    return errors


def bench(batches: list[int], contexts: list[int], rounds: int,
          max_gib: float) -> list[dict]:
    """Time every kernel beside its torch reference per context and batch; print table rows
    (skipping steps whose K+V rows exceed ``max_gib``)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results = []
    for tokens in contexts:
        for batch in batches:
            kv_bytes = 2 * batch * HKV * tokens * D * 2
            if kv_bytes > max_gib * 2**30:
                print(f"| all | {batch} | {tokens // 1024}K | skipped: K+V of "
                      f"{kv_bytes / 2**30:.0f} GiB > --max-gib | | |")
                continue
            step = Step(batch, tokens, gen)
            calls = {"triton": step.triton_calls(), "torch": step.torch_calls()}
            for kernel in KERNELS:
                times: dict[str, list[float]] = {"triton": [], "torch": []}
                for _ in range(rounds):
                    for side in ("triton", "torch"):
                        times[side].append(float(triton.testing.do_bench_cudagraph(
                            calls[side][kernel], return_mode="median")))
                tri, ref = statistics.median(times["triton"]), statistics.median(times["torch"])
                results.append({"kernel": kernel, "batch": batch, "tokens": tokens,
                                "clusters": step.clusters, "triton_ms": tri, "torch_ms": ref,
                                "speedup": ref / tri})
                print(f"| {kernel} | {batch} | {tokens // 1024}K | {tri * 1e3:.1f} "
                      f"| {ref * 1e3:.1f} | {ref / tri:.2f}x |", flush=True)
            del step, calls
            torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per side")
    parser.add_argument("--max-gib", type=float, default=40.0,
                        help="largest K+V (bf16, in place) to allocate for a step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_speed.py needs a CUDA device", file=sys.stderr)
        return 2
    errors = check_all(torch.Generator(device=DEVICE).manual_seed(1))
    print("## correctness (relative L2 error vs float64, bf16 inputs)")
    for name, err in errors.items():
        print(f"- {name}: {err:.2e} {'ok' if err < TOLERANCE else 'FAIL'}")
    print("\n## timing (µs, median of CUDA-graph replays; speedup = torch / triton)")
    print("| kernel | B | context | triton µs | torch µs | speedup |")
    print("|---|---|---|---|---|---|")
    results = bench(args.batches, args.contexts, args.rounds, args.max_gib)
    passed = all(err < TOLERANCE for err in errors.values())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                        "python": platform.python_version()},
            "versions": {"torch": torch.__version__, "triton": triton.__version__,
                         "cuda": torch.version.cuda},
            "settings": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16",
                         "centroids": "int8", "tokens_per_cluster": TOKENS_PER_CLUSTER,
                         "retrieval": RETRIEVAL, "estimation": ESTIMATION, "steady": STEADY,
                         "rounds": args.rounds, "batches": args.batches,
                         "contexts": args.contexts, "max_gib": args.max_gib},
            "correctness": {"rel_l2": errors, "tolerance": TOLERANCE, "passed": passed},
            "results": results,
        }, indent=2))
        print(f"\nwrote {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
