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


def _count_waits(monkeypatch: pytest.MonkeyPatch) -> list[torch.cuda.Stream]:
    waits: list[torch.cuda.Stream] = []
    synchronize = torch.cuda.Stream.synchronize

    def record(stream: torch.cuda.Stream) -> None:
        waits.append(stream)
        synchronize(stream)

    monkeypatch.setattr(torch.cuda.Stream, "synchronize", record)
    return waits


@pytest.mark.gpu
def test_gpu_copies_into_host_memory_made_together_are_waited_for_once(monkeypatch):
    waits = _count_waits(monkeypatch)
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


@pytest.mark.gpu
def test_gpu_host_writes_together_within_another_joins_the_outer_one(monkeypatch):
    waits = _count_waits(monkeypatch)
    tier = PinnedKVStore()
    rows = _grown(tier, 4, 64, [4096, 8192])
    src = torch.randn(4, 8192, 64, device="cuda").to(torch.bfloat16)
    with host_writes_together():
        with host_writes_together():
            copy_across(src[:, :4096], rows.keys[:, :4096])
        assert waits == []  # the inner one's copy is the outer one's to wait for
        copy_across(src[:, 4096:], rows.keys[:, 4096:])
    assert len(waits) == 1
    assert torch.equal(rows.keys, src.cpu())


@pytest.mark.gpu
def test_gpu_copy_rows_and_place_segments_wait_once_for_all_their_rows(monkeypatch):
    from vecstore.config import KVStoreConfig
    from vecstore.engine.layer_image import place_segments
    from vecstore.index.base import Segment
    from vecstore.kvstore.base import copy_rows
    from vecstore.kvstore.placement import Placement

    waits = _count_waits(monkeypatch)
    placement = Placement(KVStoreConfig(kind="pinned"))
    keys = torch.randn(4, 3000, 64, device="cuda").to(torch.bfloat16)
    values = torch.randn(4, 3000, 64, device="cuda").to(torch.bfloat16)
    rows = copy_rows(placement.tier("cuda"), keys, values)
    assert len(waits) == 1
    assert torch.equal(rows.keys, keys.cpu()) and torch.equal(rows.values, values.cpu())
    waits.clear()
    bounds = [0, 1000, 2500, 3000]  # three segments of one unit per head each
    segments = [Segment(lo, hi, keys[:, lo:hi], values[:, lo:hi],
                        torch.tensor([[0, hi - lo]] * 4, device="cuda"))
                for lo, hi in zip(bounds, bounds[1:], strict=False)]
    image = place_segments(placement, segments, torch.device("cuda"), torch.bfloat16,
                           "layer 0", None)
    assert len(waits) == 1  # six copies into host memory, waited for once
    assert torch.equal(image.rows.keys, keys.cpu())
    assert torch.equal(image.rows.values, values.cpu())
