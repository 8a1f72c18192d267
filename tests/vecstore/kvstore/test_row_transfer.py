"""copy_across: rows between the GPU and the pinned tier's reserves, registered range by range."""

from __future__ import annotations

import pytest
import torch

from vecstore.kvstore.pinned import PinnedKVStore
from vecstore.kvstore.row_transfer import copy_across, host_writes_together


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


@pytest.mark.gpu
def test_gpu_copies_into_host_memory_made_together_are_waited_for_once(monkeypatch):
    waits: list[torch.cuda.Stream] = []
    synchronize = torch.cuda.Stream.synchronize

    def record(stream: torch.cuda.Stream) -> None:
        waits.append(stream)
        synchronize(stream)

    monkeypatch.setattr(torch.cuda.Stream, "synchronize", record)
    tier = PinnedKVStore()
    heads, dim, sizes = 8, 128, [8192, 16384, 24576, 65536]
    rows = _grown(tier, heads, dim, sizes)
    src = torch.randn(heads, sizes[-1], dim, device="cuda").to(torch.bfloat16)
    with host_writes_together():
        for lo, hi in zip([0, *sizes[:-1]], sizes, strict=True):
            copy_across(src[:, lo:hi], rows.keys[:, lo:hi])
            copy_across(src[:, lo:hi], rows.values[:, lo:hi])
        assert waits == []  # none waited for yet
    assert len(waits) == 1  # all of them, on leaving
    assert torch.equal(rows.keys, src.cpu()) and torch.equal(rows.values, src.cpu())
    copy_across(src[:, :8], rows.keys[:, :8])  # outside it: waited for on return
    assert len(waits) == 2
