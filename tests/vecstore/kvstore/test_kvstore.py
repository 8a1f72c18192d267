"""KV tiers: placement, budgets checked before allocation, peak accounting."""

from __future__ import annotations

import mmap

import pytest
import torch

from vecstore.errors import CapacityError
from vecstore.kvstore import KVSTORES, GPUKVStore, KVStore, PinnedKVStore, make_kvstore


def test_registry_and_protocol():
    assert set(KVSTORES.names()) >= {"memory", "pinned"}
    for kv in (make_kvstore("memory"), make_kvstore("pinned")):
        assert isinstance(kv, KVStore)


@pytest.mark.parametrize("tier", [GPUKVStore, PinnedKVStore])
def test_budget_is_checked_before_anything_is_placed(tier):
    kv = tier(budget_gb=8192 / 2**30)  # 8 KiB
    keys = torch.randn(1, 2, 16, 32)  # 4 KiB each for keys and values
    rows = kv.store(keys, keys)
    assert torch.equal(rows.keys, keys) and rows.num_bytes == 8192
    with pytest.raises(CapacityError, match="raise the budget"):
        kv.store(keys[:, :, :1], keys[:, :, :1])
    assert kv.account.used_bytes == 8192
    kv.free(rows)
    assert kv.account.used_bytes == 0 and kv.account.peak_bytes == 8192
    kv.store(keys, keys)


def test_unbounded_by_default():
    kv = PinnedKVStore()
    kv.store(torch.zeros(1, 1, 4096, 64), torch.zeros(1, 1, 4096, 64))
    assert kv.account.budget_bytes == 0


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
