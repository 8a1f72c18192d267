"""Batched serving across GPUs: end-to-end decode on N GPUs vs 1, one process per GPU.

Each process (rank) owns one GPU, builds the same Llama-3-8B-shaped random-weight model
as ``benchmarks/e2e.py`` and serves ``batch / world_size`` of the sequences with a
:class:`integrations.hf.WaveCache` whose store lives on that GPU. Decode tokens/s of all
ranks are summed over NCCL; each rank reports its peak GPU memory. Run with ``--gpus 1``
and ``--gpus 2`` (or more) and compare.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``): on the project's machines a program using it can take the
host's GPUs out of service.

    python benchmarks/multi_gpu.py --gpus 2 --context 524288 --batch 8 [--layers 4]
"""

from __future__ import annotations

import os

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _value

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine, write_results  # noqa: E402
from benchmarks.e2e import build_model, run  # noqa: E402


def serve(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    """One rank: build the model on ``cuda:rank``, decode its share, gather the totals."""
    from integrations.hf import WaveCache

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model = build_model(args.layers)
    share = args.batch // world
    gen = torch.Generator(device="cuda").manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (share, args.context), generator=gen,
                        device="cuda")
    cfg = {"executor": {"kind": "wave", "device": f"cuda:{rank}"}}
    torch.cuda.reset_peak_memory_stats()
    with WaveCache(cfg, model) as cache:
        res = run(model, cache, ids, args.steps)
    totals = torch.tensor([res["tokens_per_s"], res["peak_gpu_gb"], res["decode_s"]],
                          device="cuda", dtype=torch.float64)
    gathered = [torch.zeros_like(totals) for _ in range(world)]
    dist.all_gather(gathered, totals)
    if rank == 0:
        per_rank = [g.tolist() for g in gathered]
        row = {"gpus": world, "batch": args.batch, "context": args.context,
               "layers": args.layers, "tokens_per_s": sum(r[0] for r in per_rank),
               "peak_gpu_gb_per_gpu": max(r[1] for r in per_rank),
               "slowest_decode_s": max(r[2] for r in per_rank)}
        name = f"multi_gpu_{world}gpu_{args.context // 1024}k"
        write_results(args.out, name, {**machine(), "steps": args.steps}, [row], list(row),
                      f"Decode across {world} GPU(s), one process per GPU")
        print(row, flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not 1 <= args.gpus <= torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    if args.batch % args.gpus:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --gpus {args.gpus}")
    mp.spawn(serve, args=(args.gpus, args, args.port), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
