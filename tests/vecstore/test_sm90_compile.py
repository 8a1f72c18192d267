"""Every Triton kernel compiles for the H200 (sm_90), checked on the CPU.

The interpreter runs a kernel's Python, not the compiler: a kernel the compiler rejects (a
global that is not a ``tl.constexpr``, say) passes every interpreter test and fails on the
first GPU run. Here the wave executor's decode step (resident, pipelined, offloaded, both
radix paths; int8, bfloat16 and float32 centroids) runs in the interpreter at the Llama head
size with every launch recorded, then each recorded launch is compiled to an sm_90 cubin by
a subprocess without the interpreter (:mod:`tests.kernel_compile`), and so is the stats
kernel of captured steps. Every kernel of :mod:`vecstore.kernels` must be among the launches.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch

import vecstore.kernels
from tests.interpreter import interpreted, request_interpreter
from tests.kernel_compile import Launch, compile_failures, recorded_launches
from vecstore.config import StoreConfig
from vecstore.executor.base import Steady
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.index.base import IndexView
from vecstore.index.wave import WaveIndex
from vecstore.kernels.backend import LazyKernel

request_interpreter()  # the kernels run on CPU tensors in Triton's interpreter

CFG = StoreConfig.from_dict({"index": {"segment_tokens": 512},
                             "attention": {"retrieval_budget": 0.05}})
H, G, D = 2, 4, 128  # KV heads, query heads per KV head, the Llama head size


def _all_kernels() -> set[str]:
    names = set()
    for info in pkgutil.iter_modules(vecstore.kernels.__path__):
        module = importlib.import_module(f"vecstore.kernels.{info.name}")
        names |= {obj.__name__ for obj in vars(module).values() if isinstance(obj, LazyKernel)}
    return names


def _inputs(dtype: torch.dtype) -> tuple[WaveIndex, IndexView, Steady, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    index = WaveIndex(CFG)
    views = [IndexView.from_segments(index.build(torch.randn(H, n, D, generator=gen).to(dtype),
                                                 torch.randn(H, n, D, generator=gen).to(dtype),
                                                 4))
             for n in (1500, 700)]
    steady = Steady(torch.randn(2, H, 40, D, generator=gen).to(dtype),
                    torch.randn(2, H, 40, D, generator=gen).to(dtype), torch.tensor([40, 17]))
    q = torch.randn(2, H * G, 1, D, generator=gen).to(dtype)
    return index, IndexView.stack(views), steady, q


def _decode(dtype: torch.dtype, softcap: float | None = None, **executor: object) -> None:
    index, view, steady, q = _inputs(dtype)
    WaveExecutor(backend="triton", **executor).run(index, view, steady, q, D ** -0.5,
                                                   CFG.for_layer(0), softcap)


def _step_stats() -> None:
    """The stats kernel of captured steps, with the NaN/Inf check (the batch decoder's) and
    without (a captured store query's)."""
    from vecstore.kernels.step_stats import accumulate_step

    index, view, steady, q = _inputs(torch.bfloat16)
    ex = WaveExecutor(backend="triton")
    prep = ex.prepare(view, CFG.for_layer(0), index)
    res = ex.decode(prep, steady, q[:, :, 0].contiguous(), D ** -0.5)
    z, kv = res.zones, steady.keys[:, :, :1]
    for checked in ((), (q, kv, kv)):
        accumulate_step(z.cum, z.count, z.est_count, res.parts_lse, res.num_exact_parts,
                        res.lse, steady.lengths, prep.tokens_total, H,
                        torch.zeros(5, dtype=torch.float64), checked,
                        torch.ones((), dtype=torch.int32))


def _row_copy() -> None:
    """The copy of a pinned layer's stored prefix for a prefill chunk (bf16, head dim 128)."""
    from vecstore.kernels.row_copy import copy_rows

    rows = torch.randn(8, 70, 128).to(torch.bfloat16)
    copy_rows(rows, torch.empty_like(rows))


def _nearest_centroid() -> None:
    """The k-means assignment of an index build (float32 points, head dim 128)."""
    from vecstore.kernels.nearest_centroid import nearest_centroid

    nearest_centroid(torch.randn(2, 70, 128), torch.randn(2, 40, 128))


@interpreted
def test_every_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    from vecstore.executor import wave_streams
    from vecstore.kernels import radix_select

    with recorded_launches() as launches:
        _decode(torch.bfloat16)  # rows short enough for one program per row
        monkeypatch.setattr(radix_select, "_ROW_RADIX_MAX", 0)  # the candidate-list path
        monkeypatch.setattr(wave_streams, "_PIPELINE_MIN_ROWS", 1)
        monkeypatch.setattr(wave_streams, "_PIPELINE_MIN_SCORES", 0)
        _decode(torch.bfloat16)  # in pipelined row groups
        _decode(torch.bfloat16, simulate_offload=True)
        _decode(torch.float32, score_dtype=torch.float32)
        _decode(torch.bfloat16, score_dtype=torch.bfloat16)  # the default scores int8 codes
        _decode(torch.bfloat16, softcap=50.0)  # the soft-capped kernels (Gemma 2)
        _decode(torch.bfloat16, softcap=50.0, simulate_offload=True)
        _step_stats()
        _row_copy()
        _nearest_centroid()
    assert {launch.name for launch in launches} == _all_kernels()
    # kernels chained by programmatic dependent launch on the GPU (GDC) compile that way too
    launches += [Launch(x.module, x.name, x.signature, {**x.constants, "GDC": True},
                        {**x.options, "launch_pdl": True})
                 for x in launches if x.constants.get("GDC") is False]
    assert compile_failures(launches, tmp_path) == {}
