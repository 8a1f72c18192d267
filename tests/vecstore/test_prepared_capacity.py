"""A prepared view's zone and row-map capacities: whole multiples of 16 that cover the zones.

They are kernel arguments, which Triton specializes on divisibility by 16: capacities that
crossed that line as a layer grew made every kernel taking them compile again at the next
segment (seconds of a decode step on the H200)."""

from __future__ import annotations

import pytest
import torch

from vecstore.config import StoreConfig
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.index.base import IndexView
from vecstore.index.wave import WaveIndex

CFG = StoreConfig.from_dict({"index": {"segment_tokens": 256},
                             "attention": {"retrieval_budget": 0.1, "estimation_budget": 0.3}})


@pytest.mark.parametrize("lengths", [(900, 500, 700), (33,), (4000, 17)])
def test_capacities_are_multiples_of_16_covering_every_row(lengths):
    gen = torch.Generator().manual_seed(len(lengths))
    index = WaveIndex(CFG)
    views = []
    for n in lengths:
        k, v = torch.randn(2, 2, n, 16, generator=gen)
        views.append(IndexView.from_segments(index.build(k, v, 4)))
    view = IndexView.stack(views)
    prep = WaveExecutor(backend="triton", use_graphs=False).prepare(
        view, CFG.for_layer(0), index)
    k1, est = int(prep.k1.max()), int((prep.k2 - prep.k1).max())
    sizes = prep.sizes.sort(dim=1, descending=True).values
    rows = int(sizes[:, :k1].sum(1).max())
    for capacity, need in ((prep.r_max, k1), (prep.e_max, est), (prep.max_rows, rows)):
        assert capacity % 16 == 0
        assert need <= capacity < need + 16 or (need == 0 and capacity == 16)
