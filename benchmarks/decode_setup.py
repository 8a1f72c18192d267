"""What the decode benchmarks share: the attention shape and budgets, synthetic inputs and
drifting queries, CUDA graph capture, and the measures of a step (relative error, exact
attention, the bytes the method must move). Used by ``decode.py``, ``variants.py``,
``offloaded_variants.py`` and ``timeline.py``."""

from __future__ import annotations

import math

import torch

from benchmarks.common import synthetic_view
from vecstore.config import StoreConfig
from vecstore.executor.base import Steady
from vecstore.index.base import IndexView
from vecstore.kvstore import PinnedKVStore
from vecstore.kvstore.base import StoredRows

HQ, HKV, D, TPC = 32, 8, 128, 16
STEADY_CAP = 4 + 64 + 1024  # sinks + window + tokens awaiting clustering
CFG = StoreConfig()
LAYER = CFG.for_layer(0)
SCALE = D ** -0.5


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def make_inputs(batch: int, tokens: int, dev: torch.device, seed: int):
    view = synthetic_view(batch, tokens, HKV, D, tokens_per_cluster=TPC, device=dev, seed=seed)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    sk = torch.randn(batch, HKV, STEADY_CAP, D, generator=gen, device=dev).bfloat16()
    sv = torch.randn(batch, HKV, STEADY_CAP, D, generator=gen, device=dev).bfloat16()
    lengths = torch.randint(68, STEADY_CAP + 1, (batch,), generator=gen, device=dev)
    steady = Steady(sk, sv, lengths)
    # queries near stored keys, so attention is peaked as in a real model
    pick = torch.randint(0, tokens, (batch, HQ), generator=gen, device=dev)
    kv_head = torch.arange(HQ, device=dev) // (HQ // HKV)
    q = view.keys[torch.arange(batch, device=dev)[:, None], kv_head[None, :], pick].float()
    q = (q + 0.3 * torch.randn(q.shape, generator=gen, device=dev)).bfloat16()
    return view, steady, q


def pinned_view(view: IndexView) -> tuple[PinnedKVStore, StoredRows, IndexView]:
    """``view``'s KV rows copied into pinned host memory: the store, the rows (give them
    back with ``store.free(rows)``) and the same view over them, as the offloaded benchmarks
    serve it."""
    store = PinnedKVStore()
    rows = store.store(view.keys, view.values)
    return store, rows, IndexView(keys=rows.keys, values=rows.values, offsets=view.offsets,
                                  sizes=view.sizes, meta=view.meta, num_units=view.num_units)


def full_attention(view: IndexView, steady: Steady, q: torch.Tensor) -> torch.Tensor:
    """Exact float32 attention of ``q [B, HQ, D]`` over each sequence's steady zone and view
    rows: what the wave step approximates, ``[B, HQ, 1, D]``."""
    outs = []
    for b in range(q.shape[0]):
        n = int(steady.lengths[b])
        k = torch.cat([steady.keys[b, :, :n], view.keys[b]], dim=1).float()
        v = torch.cat([steady.values[b, :, :n], view.values[b]], dim=1).float()
        qb = q[b].float().view(HKV, HQ // HKV, D)
        p = (torch.einsum("hgd,hnd->hgn", qb, k) * SCALE).softmax(dim=-1)
        outs.append(torch.einsum("hgn,hnd->hgd", p, v).reshape(HQ, 1, D))
        del k, v, p
    return torch.stack(outs)


def ideal_bytes(view: IndexView, res, steady: Steady, prep) -> dict[str, float]:
    """Bytes the method must move per step (each read once); the centroids as the prepared
    view ``prep`` scores them (int8 codes and their scales, or bfloat16)."""
    z = res.zones
    retrieved_rows = float(z.cum.gather(1, z.count[:, None].long()).sum())
    estimated = float((z.zone == 2).sum())
    scales = prep.code_scales
    return {
        "centroid_bytes": float(prep.centroids.numel() * prep.centroids.element_size()
                                + (scales.numel() * scales.element_size() if scales is not None
                                   else 0)),
        "retrieved_bytes": retrieved_rows * D * 2 * 2,
        "estimated_bytes": estimated * D * 2.0,
        "steady_bytes": float(steady.lengths.sum()) * view.keys.shape[1] * D * 2 * 2,
        "retrieved_rows": retrieved_rows,
    }


def capture(fn):
    """Capture ``fn`` in a CUDA graph after warm-up; returns (graph, fn's result)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        res = fn()
    return graph, res


def drift(q: torch.Tensor, gen: torch.Generator, rho: float) -> torch.Tensor:
    noise = torch.randn(q.shape, generator=gen, device=q.device) * q.float().std()
    return (rho * q.float() + math.sqrt(1 - rho * rho) * noise).bfloat16()
