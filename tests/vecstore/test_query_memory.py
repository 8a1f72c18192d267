"""Multi-token queries (prefill chunks) hold bounded score slices, never [B, Hkv, G, L, C].

A chunk of L query tokens over C clusters used to materialise the ranking logits
``[B, Hkv, G, L, C]`` float32 three times over (17 GB each at batch 8, 2048-token chunks,
128K context), and a batch query stacked a padded copy of every row's KV. These tests
shrink :data:`vecstore.slicing.SCORE_BUDGET`, check the sliced results equal the unsliced
ones, and check (deterministically, by the largest storage any op allocates) that no
allocation anywhere near the full score tensor or a stacked KV copy is made.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import vecstore.slicing
from vecstore import Store
from vecstore.config import StoreConfig
from vecstore.executor.base import Steady
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.index.base import IndexView
from vecstore.index.wave import WaveIndex

B, HQ, H, D, N, L = 2, 8, 2, 16, 2048, 64
SLICE = 4096  # score elements per slice under test (16 KiB of float32)


class LargestAllocation(TorchDispatchMode):
    """The largest storage (bytes) created by any op inside the block (views and in-place
    results of existing tensors are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr()
                for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _store(kind: str) -> tuple[Store, list]:
    store = Store.open(config={"index": {"kind": kind, "tokens_per_cluster": 4,
                                         "page_tokens": 4, "segment_tokens": 1024}})
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for b in range(B):
        seq = store.create(f"s{b}", num_layers=1, num_kv_heads=H, head_dim=D,
                           dtype=torch.float32)
        seq.append(0, torch.randn(H, N - 64 * b, D, generator=gen),
                   torch.randn(H, N - 64 * b, D, generator=gen))
        seqs.append(seq)
    return store, seqs


@pytest.mark.parametrize("kind", ["wave", "quest", "topk_oracle"])
def test_chunk_query_is_sliced_and_equals_the_unsliced_query(kind, monkeypatch):
    store, seqs = _store(kind)
    q = torch.randn(B, HQ, L, D, generator=torch.Generator().manual_seed(1))
    whole = store.query(seqs, 0, q)  # default budget: one slice at this size
    monkeypatch.setattr(vecstore.slicing, "SCORE_BUDGET", SLICE)
    with LargestAllocation() as mode:
        sliced = store.query(seqs, 0, q)
    torch.testing.assert_close(sliced.out, whole.out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sliced.lse, whole.lse, rtol=1e-5, atol=1e-5)
    assert sliced.stats.units_retrieved == whole.stats.units_retrieved
    assert sliced.stats.tokens_exact == whole.stats.tokens_exact
    assert sliced.stats.estimated_mass == pytest.approx(whole.stats.estimated_mass, rel=1e-5)
    # per row, the scores of one query token: [Hkv, G, 1, C] (quest: [Hkv, G, 1, C, D]);
    # all L of them are ~1 MiB (quest 16 MiB), a stacked copy of both rows' keys 512 KiB;
    # what may stay is q and out (64 KiB) and a slice (at least one query token)
    units = store.sequence("s0").layers[0].view().sizes.shape[-1]
    per_token = HQ * units * 4 * (D if kind == "quest" else 1)
    limit = max(96 * 1024, per_token)
    assert L * per_token >= 8 * limit
    assert mode.largest <= limit, mode.largest


def test_batched_reference_executor_slices_queries(monkeypatch):
    """The executor itself (a stacked B > 1 view, as a caller may pass): the same zones,
    slice by slice, equal the unsliced result, and no [B, Hkv, G, L, C] scores exist."""
    cfg = StoreConfig.from_dict({"index": {"tokens_per_cluster": 4, "segment_tokens": 1024},
                                 "attention": {"retrieval_budget": 0.05}})
    idx = WaveIndex(cfg)
    gen = torch.Generator().manual_seed(2)
    views = [IndexView.from_segments(idx.build(torch.randn(H, N, D, generator=gen),
                                               torch.randn(H, N, D, generator=gen), 4))
             for _ in range(B)]
    view = IndexView.stack(views)
    steady = Steady(torch.randn(B, H, 70, D, generator=gen),
                    torch.randn(B, H, 70, D, generator=gen), torch.tensor([70, 40]))
    q = torch.randn(B, HQ, L, D, generator=gen)
    layer = cfg.for_layer(0)
    out, lse, stats = TorchExecutor().run(idx, view, steady, q, D ** -0.5, layer)
    monkeypatch.setattr(vecstore.slicing, "SCORE_BUDGET", SLICE)
    with LargestAllocation() as mode:
        out_s, lse_s, stats_s = TorchExecutor().run(idx, view, steady, q, D ** -0.5, layer)
    torch.testing.assert_close(out_s, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_s, lse, rtol=1e-5, atol=1e-5)
    assert (stats_s.units_retrieved, stats_s.units_estimated, stats_s.tokens_exact) == (
        stats.units_retrieved, stats.units_estimated, stats.tokens_exact)
    assert stats_s.estimated_mass == pytest.approx(stats.estimated_mass, rel=1e-5)
    full = B * HQ * L * view.sizes.shape[-1] * 4  # the [B, Hkv, G, L, C] logits: 2 MiB
    assert mode.largest <= full // 16, (mode.largest, full)
