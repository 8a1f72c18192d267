"""The :class:`~vecstore.executor.Executor` contract, for every executor in ``EXECUTORS``.

Each executor is built as a store builds it (:func:`~vecstore.executor.base.build_executor`)
on CUDA where a GPU is present, on the CPU otherwise, and run over every index: at a full
retrieval budget its answer is exact attention over the steady zone and the indexed rows of
each sequence of a padded batch, for decode (one query token) and prefill-like queries.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import exact_attention, rel_err
from vecstore.config import StoreConfig
from vecstore.executor import EXECUTORS, Executor, Steady
from vecstore.executor.base import build_executor
from vecstore.index import INDEXES, Index, IndexView

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, G, D = 2, 2, 32
LENGTHS, STEADY = (300, 130), (20, 7)
CFG = {"index": {"tokens_per_cluster": 8, "segment_tokens": 128, "page_tokens": 8},
       "attention": {"retrieval_budget": 1.0}}


def _executor(name: str) -> Executor:
    config = StoreConfig.from_dict({**CFG, "executor": {"kind": name, "device": DEVICE}})
    executor = build_executor(config)
    assert isinstance(executor, Executor)
    return executor


def _case(index_kind: str, q_len: int, seed: int) -> tuple[Index, IndexView, Steady,
                                                           torch.Tensor, list]:
    """A batch of two sequences of different lengths and what each one holds, unpadded."""
    gen = torch.Generator().manual_seed(seed)
    index = INDEXES.get(index_kind)(StoreConfig.from_dict(CFG))
    views, held = [], []
    S = max(STEADY)
    steady_k, steady_v = torch.randn(2, 2, H, S, D, generator=gen)
    for b, n in enumerate(LENGTHS):
        k, v = torch.randn(2, H, n, D, generator=gen)
        views.append(IndexView.from_segments(index.build(k.to(DEVICE), v.to(DEVICE), S)))
        s = STEADY[b]
        held.append((torch.cat([steady_k[b, :, :s], k], 1), torch.cat([steady_v[b, :, :s], v], 1)))
    steady = Steady(steady_k.to(DEVICE), steady_v.to(DEVICE), torch.tensor(STEADY, device=DEVICE))
    q = torch.randn(2, H * G, q_len, D, generator=gen).to(DEVICE)
    return index, IndexView.stack(views), steady, q, held


@pytest.mark.parametrize("name", EXECUTORS.names())
@pytest.mark.parametrize("index_kind", INDEXES.names())
@pytest.mark.parametrize("q_len", [1, 3])
def test_a_full_budget_is_exact_attention(name: str, index_kind: str, q_len: int) -> None:
    index, view, steady, q, held = _case(index_kind, q_len, seed=q_len)
    layer = StoreConfig.from_dict(CFG).for_layer(0)
    out, lse, stats = _executor(name).run(index, view, steady, q, D ** -0.5, layer)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    for b, (keys, values) in enumerate(held):
        ref_out, ref_lse = exact_attention(q[b].cpu(), keys, values)
        assert rel_err(out[b].cpu(), ref_out) < 1e-5 and rel_err(lse[b].cpu(), ref_lse) < 1e-5
    total = sum(LENGTHS) + sum(STEADY)
    assert stats.tokens_exact == stats.tokens_total == total


@pytest.mark.parametrize("name", EXECUTORS.names())
def test_with_nothing_indexed_the_steady_zone_is_attended(name: str) -> None:
    index, _, steady, q, _ = _case("wave", 1, seed=5)
    layer = StoreConfig.from_dict(CFG).for_layer(0)
    out, lse, stats = _executor(name).run(index, None, steady, q, D ** -0.5, layer)
    for b, s in enumerate(STEADY):
        ref_out, ref_lse = exact_attention(q[b].cpu(), steady.keys[b, :, :s].cpu(),
                                           steady.values[b, :, :s].cpu())
        assert rel_err(out[b].cpu(), ref_out) < 1e-5 and rel_err(lse[b].cpu(), ref_lse) < 1e-5
    assert stats.tokens_exact == stats.tokens_total == sum(STEADY)
