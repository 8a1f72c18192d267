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


class _FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; fails registration number
    ``fail_at`` (counting from 0) with error 2."""

    def __init__(self, fail_at: int = -1) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.calls = 0
        self.fail_at = fail_at

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            return 2
        assert ptr not in self.registered, "registered twice at one address"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.registered[ptr]
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802
        return 0


def _fake_cuda(monkeypatch, cudart: _FakeCudart) -> None:
    from vecstore.kvstore import pinned

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(pinned, "_REGISTERED", {})  # this test's registrations only


def test_pinned_memory_stays_mapped_while_registered(monkeypatch):
    import gc

    from vecstore.kvstore.pinned import registered_bytes

    cudart = _FakeCudart()
    _fake_cuda(monkeypatch, cudart)
    kv = PinnedKVStore()
    keys = torch.randn(1, 2, 64, 16)
    nbytes = keys.numel() * 4
    kept = kv.store(keys, keys)
    dropped = kv.store(keys, keys)
    ptrs = {dropped.keys.data_ptr(), dropped.values.data_ptr()}
    assert len(cudart.registered) == 4 and registered_bytes() == 4 * nbytes
    kv.free(kept)
    assert set(cudart.registered) == ptrs and registered_bytes() == 2 * nbytes
    kv.free(kept)  # a second free unregisters nothing twice
    assert set(cudart.registered) == ptrs
    del dropped, kv  # dropped unfreed, and the store too: still registered, so still mapped
    gc.collect()
    assert set(cudart.registered) == ptrs and registered_bytes() == 2 * nbytes
    fresh = PinnedKVStore().store(keys, keys)  # never at an address still registered
    assert not ptrs & {fresh.keys.data_ptr(), fresh.values.data_ptr()}
    assert torch.equal(fresh.keys, keys)


def test_failed_pinning_unregisters_what_it_registered(monkeypatch):
    from vecstore.kvstore.pinned import registered_bytes

    cudart = _FakeCudart(fail_at=1)  # the values' registration fails
    _fake_cuda(monkeypatch, cudart)
    kv = PinnedKVStore()
    with pytest.raises(CapacityError, match="could not pin .* error 2"):
        kv.store(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16))
    assert cudart.registered == {} and len(cudart.unregistered) == 1
    assert registered_bytes() == 0 and kv.account.used_bytes == 0
