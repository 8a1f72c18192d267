"""What the two built-in tiers do beyond the contract every tier keeps
(``tests/contracts/test_kvstore_contract.py``): pinned pages, rows on the GPU."""

from __future__ import annotations

import mmap

import pytest
import torch

from vecstore.errors import CapacityError
from vecstore.kvstore import GPUKVStore, PinnedKVStore


@pytest.mark.gpu
def test_pinned_tier_is_page_locked():
    rows = PinnedKVStore().store(torch.ones(1, 1, 8, 16), torch.ones(1, 1, 8, 16))
    assert rows.keys.is_pinned() and rows.values.is_pinned()


@pytest.mark.gpu
def test_pinned_pages_stay_registered_while_viewed_and_go_with_the_last_view(monkeypatch):
    # dropped rows are unpinned before unmapped: later rows reusing their addresses pin
    # (a range unmapped while registered made CUDA refuse the next one at its addresses)
    for _ in range(8):
        PinnedKVStore().store(torch.ones(2, 2, 20000, 32), torch.ones(2, 2, 20000, 32))
    from vecstore.kvstore import pinned

    mappings = []
    make = pinned._page_aligned

    def keep_mapping(n):
        host, mapping, exported = make(n)
        mappings.append(mapping)  # held here, so still mapped after the tensors go
        return host, mapping, exported

    monkeypatch.setattr(pinned, "_page_aligned", keep_mapping)
    tier = PinnedKVStore()
    rows = tier.store(torch.ones(1, 1, 8, 16), torch.ones(1, 1, 8, 16))
    keys = rows.keys[0, 0, 2:]
    tier.free(rows)
    del rows
    assert keys.is_pinned()  # freed, but still viewed
    del keys
    assert not any(torch.frombuffer(m, dtype=torch.uint8).is_pinned() for m in mappings)
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


@pytest.mark.gpu
def test_a_failed_pin_is_a_capacity_error_and_leaves_cuda_usable(monkeypatch):
    from vecstore.kvstore import pinned

    same = pinned._page_aligned(mmap.PAGESIZE)
    # keys and values handed one range: the values' pin fails (already registered)
    monkeypatch.setattr(pinned, "_page_aligned", lambda n: same)
    tier = PinnedKVStore()
    with pytest.raises(CapacityError, match="could not pin"):
        tier.allocate((1, 1, 1, mmap.PAGESIZE // 2), torch.bfloat16)
    assert tier.account.used_bytes == 0
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # no error left pending


@pytest.mark.gpu
def test_gpu_tier_lives_on_the_gpu():
    rows = GPUKVStore("cuda").store(torch.ones(1, 1, 8, 16), torch.ones(1, 1, 8, 16))
    assert rows.keys.is_cuda


def test_pinned_tier_pages_are_aligned_and_its_own():
    # cudaHostRegister works on whole pages: a buffer sharing a page with one already
    # registered fails with cudaErrorHostMemoryAlreadyRegistered (seen on the H200)
    from vecstore.kvstore.pinned import _page_aligned

    bufs = [_page_aligned(n)[0] for n in (24, 750592, 3)]
    assert all(b.data_ptr() % mmap.PAGESIZE == 0 for b in bufs)
    assert len({b.data_ptr() // mmap.PAGESIZE for b in bufs}) == 3
    x = bufs[0].view(torch.bfloat16).view(3, 4)
    x.fill_(1.5)
    assert x.sum().item() == 18.0
