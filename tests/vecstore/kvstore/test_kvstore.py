"""What the two built-in tiers do beyond the contract every tier keeps
(``tests/contracts/test_kvstore_contract.py``): pinned pages, rows on the GPU."""

from __future__ import annotations

import mmap

import pytest
import torch

from vecstore.kvstore import GPUKVStore, PinnedKVStore


@pytest.mark.gpu
def test_pinned_tier_is_page_locked():
    rows = PinnedKVStore().store(torch.ones(1, 1, 8, 16), torch.ones(1, 1, 8, 16))
    assert rows.keys.is_pinned() and rows.values.is_pinned()


@pytest.mark.gpu
def test_gpu_tier_lives_on_the_gpu():
    rows = GPUKVStore("cuda").store(torch.ones(1, 1, 8, 16), torch.ones(1, 1, 8, 16))
    assert rows.keys.is_cuda


def test_pinned_tier_pages_are_aligned_and_its_own():
    # cudaHostRegister works on whole pages: a buffer sharing a page with one already
    # registered fails with cudaErrorHostMemoryAlreadyRegistered (seen on the H200)
    from vecstore.kvstore.pinned import _page_aligned

    bufs = [_page_aligned(n) for n in (24, 750592, 3)]
    assert all(b.data_ptr() % mmap.PAGESIZE == 0 for b in bufs)
    assert len({b.data_ptr() // mmap.PAGESIZE for b in bufs}) == 3
    x = bufs[0].view(torch.bfloat16).view(3, 4)
    x.fill_(1.5)
    assert x.sum().item() == 18.0
