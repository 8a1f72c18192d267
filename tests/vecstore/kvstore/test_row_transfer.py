"""copy_across: rows between the GPU and the pinned tier's reserves, registered range by range."""

from __future__ import annotations

import pytest
import torch

from vecstore.kvstore.pinned import PinnedKVStore
from vecstore.kvstore.row_transfer import copy_across


def _grown(tier: PinnedKVStore, heads: int, dim: int, sizes: list[int]):
    # rows grown segment by segment as a layer's are: heads a reserve apart, each head's rows
    # registered in several ranges
    rows = tier.allocate((heads, sizes[0], dim), torch.bfloat16)
    for n in sizes[1:]:
        rows = tier.extend(rows, n)
    return rows


def test_copy_across_host_rows_without_cuda_is_a_plain_copy():
    gen = torch.Generator().manual_seed(0)
    tier = PinnedKVStore()
    rows = _grown(tier, 3, 16, [5, 9, 40])
    src = torch.randn(3, 31, 16, generator=gen).to(torch.bfloat16)
    copy_across(src, rows.keys[:, 9:])
    assert torch.equal(rows.keys[:, 9:], src)
    back = torch.empty(3, 31, 16, dtype=torch.bfloat16)
    copy_across(rows.keys[:, 9:], back)
    assert torch.equal(back, src)


@pytest.mark.gpu
def test_gpu_copy_across_writes_and_reads_rows_spanning_registrations():
    gen = torch.Generator().manual_seed(1)
    tier = PinnedKVStore()
    heads, dim, sizes = 8, 128, [8192, 16384, 24576]
    rows = _grown(tier, heads, dim, sizes)
    src = torch.randn(heads, sizes[-1], dim, generator=gen).to(torch.bfloat16).cuda()
    for lo, hi in zip([0, *sizes[:-1]], sizes, strict=True):  # as segments are placed
        copy_across(src[:, lo:hi], rows.keys[:, lo:hi])
    assert torch.equal(rows.keys, src.cpu())  # visible to the host on return
    back = torch.empty(heads, sizes[-1], dim, dtype=torch.bfloat16, device="cuda")
    copy_across(rows.keys, back)
    assert torch.equal(back, src)
