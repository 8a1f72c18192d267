"""What the two built-in tiers do beyond the contract every tier keeps
(``tests/contracts/test_kvstore_contract.py``): pinned pages, rows on the GPU."""

from __future__ import annotations

import mmap
import resource
import threading

import pytest
import torch

from vecstore.errors import CapacityError
from vecstore.kvstore import GPUKVStore, PinnedKVStore, host_pages
from vecstore.kvstore.base import growable_rows
from vecstore.kvstore.host_pages import HostPages, fault_in


@pytest.mark.gpu
def test_pinned_tier_is_page_locked():
    rows = PinnedKVStore().store(torch.ones(1, 1, 8, 16), torch.ones(1, 1, 8, 16))
    assert rows.keys.is_pinned() and rows.values.is_pinned()


@pytest.mark.gpu
def test_pinned_pages_are_unregistered_with_their_last_view():
    # rows dropped unfreed: later mappings reuse their addresses and must pin (a range
    # unmapped while registered made CUDA refuse the next one at its addresses)
    for _ in range(8):
        PinnedKVStore().store(torch.ones(2, 2, 20000, 32), torch.ones(2, 2, 20000, 32))
    pages, memory = HostPages.map(4 * mmap.PAGESIZE, register=True)
    pages.pin(0, mmap.PAGESIZE)
    pages.pin(mmap.PAGESIZE, 3 * mmap.PAGESIZE)
    view = memory[100:]
    del memory
    assert view.is_pinned() and pages.num_pinned == 2
    del view
    assert not pages.alive and pages.num_pinned == 0
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


@pytest.mark.gpu
def test_a_failed_pin_is_a_capacity_error_and_leaves_cuda_usable():
    pages, memory = HostPages.map(mmap.PAGESIZE, register=True)
    pages.pin(0, mmap.PAGESIZE)
    with pytest.raises(CapacityError, match=f"could not pin {mmap.PAGESIZE} bytes"):
        pages.pin(0, mmap.PAGESIZE)  # already registered
    assert pages.num_pinned == 1
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # no error left pending
    assert memory.is_pinned()


@pytest.mark.gpu
def test_rows_grown_in_place_are_pinned_as_they_grow():
    tier = PinnedKVStore()
    rows = tier.store(torch.ones(8, 100, 128), torch.ones(8, 100, 128))
    for n in (300, 5000, 5001, 9000):
        rows = tier.extend(rows, n)
        rows.keys[:, -1] = 2.0
        assert rows.keys.is_pinned() and rows.values[:, n - 1].is_pinned()
    assert float(rows.keys[:, :100].sum()) == 8 * 100 * 128


@pytest.mark.gpu
def test_gpu_tier_lives_on_the_gpu():
    rows = GPUKVStore("cuda").store(torch.ones(1, 1, 8, 16), torch.ones(1, 1, 8, 16))
    assert rows.keys.is_cuda


def test_pinned_tier_pages_are_aligned_and_its_own():
    # cudaHostRegister works on whole pages: a buffer sharing a page with one already
    # registered fails with cudaErrorHostMemoryAlreadyRegistered (seen on the H200)
    bufs = [HostPages.map(n, register=False)[1] for n in (24, 750592, 3)]
    assert all(b.data_ptr() % mmap.PAGESIZE == 0 for b in bufs)
    assert len({b.data_ptr() // mmap.PAGESIZE for b in bufs}) == 3
    x = bufs[0].view(torch.bfloat16).view(3, 4)
    x.fill_(1.5)
    assert x.sum().item() == 18.0


def test_growable_pinned_rows_grow_in_place_from_the_first_growth():
    tier = PinnedKVStore()
    rows = growable_rows(tier, (2, 4, 100, 8), torch.float32)
    rows.keys.fill_(1.0)
    ptr = rows.keys.data_ptr()
    for n in (101, 250, 400):  # within the reserve of 16 x 100 rows
        rows = tier.extend(rows, n)
        assert rows.keys.data_ptr() == ptr and rows.keys.shape == (2, 4, n, 8)
        assert rows.num_bytes == tier.account.used_bytes == 2 * 2 * 4 * n * 8 * 4
    assert float(rows.keys[:, :, :100].sum()) == 2 * 4 * 100 * 8
    rows = tier.extend(rows, 4000)  # past it: moved once, the rows kept
    assert rows.keys.data_ptr() != ptr and float(rows.keys[:, :, :100].sum()) == 6400
    tier.free(rows)
    assert tier.account.used_bytes == 0


def test_growable_rows_reserve_for_the_room_asked():
    tier = PinnedKVStore()
    rows = growable_rows(tier, (2, 4, 100, 8), torch.float32, room=300)
    rows.keys.fill_(1.0)
    ptr = rows.keys.data_ptr()
    assert rows.num_bytes == tier.account.used_bytes == 2 * 2 * 4 * 100 * 8 * 4  # 100 rows
    rows = tier.extend(rows, 4000)  # within 16 x 300 rows: in place
    assert rows.keys.data_ptr() == ptr and float(rows.keys[:, :, :100].sum()) == 6400
    rows = tier.extend(rows, 5000)  # past it: moved
    assert rows.keys.data_ptr() != ptr and float(rows.keys[:, :, :100].sum()) == 6400
    tier.free(rows)
    assert tier.account.used_bytes == 0


def test_split_pinned_rows_grow_in_place_in_their_heads_registering_each_range_once(
        monkeypatch):
    asked: list[tuple[HostPages, int, int]] = []
    pin = HostPages.pin

    def record(pages: HostPages, offset: int, num_bytes: int, *, fault: bool = True) -> None:
        asked.append((pages, offset, num_bytes))
        pin(pages, offset, num_bytes, fault=fault)

    monkeypatch.setattr(HostPages, "pin", record)
    tier = PinnedKVStore()
    stack = growable_rows(tier, (3, 2, 100, 8), torch.float32)  # reserve: 16 x 100 rows
    stack.keys.fill_(1.0)
    ptr, stride = stack.keys.data_ptr(), stack.keys.stride()
    parts = tier.split(stack)
    for n in (101, 250, 400):  # each batch row grows within its heads of the reserve
        for b in range(3):
            parts[b] = tier.extend(parts[b], n)
            assert parts[b].keys.data_ptr() == ptr + b * stride[0] * 4
            assert parts[b].keys.stride() == stride[1:]
            parts[b].keys[:, -1] = float(b)
        assert tier.account.used_bytes == 3 * 2 * 2 * n * 8 * 4
    grown = stack.keys.as_strided((3, 2, 400, 8), stride)  # the stack sees every row
    assert all(float(grown[b, :, -1].sum()) == 2 * 8 * b for b in range(3))
    assert float(grown[:, :, :100].sum()) == 3 * 2 * 100 * 8
    for pages in {id(p): p for p, _, _ in asked}.values():  # whole pages, none twice
        ranges = sorted((o, o + n) for p, o, n in asked if p is pages)
        assert all(o % mmap.PAGESIZE == 0 == n % mmap.PAGESIZE for o, n in ranges)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    # the rows of every head are registered: its ranges (none overlapping) cover them
    head_bytes = stride[1] * 4
    for b in range(3):
        for h in range(2):
            start = (b * 2 + h) * head_bytes
            mine = [(o, n) for p, o, n in asked
                    if p.base == ptr and start <= o < start + head_bytes]
            assert min(o for o, _ in mine) == start and sum(n for _, n in mine) >= 400 * 32
            assert all(o + n <= start + head_bytes for o, n in mine)
    parts[2] = tier.extend(parts[2], 5000)  # past it: moved out, the rows kept
    assert parts[2].keys.data_ptr() != ptr + 2 * stride[0] * 4
    assert float(parts[2].keys[:, :100].sum()) == 2 * 100 * 8
    for part in parts:
        tier.free(part)
    assert tier.account.used_bytes == 0


def _faults_writing(memory: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    memory.fill_(9)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("threads", [1, 3])
def test_fault_in_commits_the_pages_and_keeps_their_contents(monkeypatch, threads):
    # what the pinned tier does before registering a range: cudaHostRegister of untouched
    # pages faults them in one by one inside the call
    monkeypatch.setattr(host_pages, "_FAULT_THREADS", threads)
    monkeypatch.setattr(host_pages, "_FAULT_PART", 64 * mmap.PAGESIZE)
    host_pages._fault_pool.cache_clear()
    pages = 256
    control = HostPages.map(pages * mmap.PAGESIZE, register=False)[1]
    faults = _faults_writing(control)
    if faults < pages // 2:
        pytest.skip("anonymous pages are faulted in huge here")
    mapped, memory = HostPages.map(pages * mmap.PAGESIZE + 7, register=False)
    mark = slice(100 * mmap.PAGESIZE, 100 * mmap.PAGESIZE + 5)  # reads fault pages in too:
    memory[mark] = torch.arange(1, 6, dtype=torch.uint8)  # touch and read one page only
    if not fault_in([(mapped.base + mmap.PAGESIZE, pages * mmap.PAGESIZE)]):
        pytest.skip("no madvise(MADV_POPULATE_WRITE) here")
    assert memory[mark].tolist() == [1, 2, 3, 4, 5]
    assert _faults_writing(memory) < faults - pages // 2
    assert int(memory.sum()) == 9 * memory.numel()
    host_pages._fault_pool.cache_clear()


def test_fault_in_does_nothing_when_turned_off(monkeypatch):
    monkeypatch.setattr(host_pages, "_FAULT_THREADS", 0)
    pages, memory = HostPages.map(mmap.PAGESIZE, register=False)
    assert not fault_in([(pages.base, mmap.PAGESIZE)])


@pytest.fixture
def ahead_pool():
    host_pages._ahead_pool.cache_clear()
    if host_pages._madvise() is None:
        pytest.skip("no madvise(MADV_POPULATE_WRITE) here")
    yield host_pages._ahead_pool()
    host_pages._ahead_pool.cache_clear()


def test_fault_ahead_commits_the_pages_in_the_background(ahead_pool):
    n = 256
    faults = _faults_writing(HostPages.map(n * mmap.PAGESIZE, register=False)[1])
    if faults < n // 2:
        pytest.skip("anonymous pages are faulted in huge here")
    pages, memory = HostPages.map(n * mmap.PAGESIZE, register=False)
    memory[: 2 * mmap.PAGESIZE] = 3
    pages.fault_ahead([(mmap.PAGESIZE, 100 * mmap.PAGESIZE), (150 * mmap.PAGESIZE, 0)])
    pages.settle()
    assert int(memory[: 2 * mmap.PAGESIZE].sum()) == 3 * 2 * mmap.PAGESIZE  # kept
    # the 100 pages faulted in ahead do not fault when written; the rest do
    assert faults - 100 - n // 8 < _faults_writing(memory) < faults - 100 + n // 8


def test_fault_ahead_keeps_the_mapping_until_it_is_done(ahead_pool):
    gate = threading.Event()
    ahead_pool.submit(gate.wait)  # one thread: the faulting waits behind this
    pages, memory = HostPages.map(16 * mmap.PAGESIZE, register=False)
    pages.fault_ahead([(0, 16 * mmap.PAGESIZE)])
    del memory
    assert pages.alive  # only the queued job views it
    gate.set()
    pages.settle()
    assert not pages.alive


def test_a_growth_faults_the_next_one_in_ahead_and_registers_it_later(monkeypatch,
                                                                     ahead_pool):
    # registration recorded, not made (no CUDA here): what the tier asks of its pages
    pinned: list[tuple[int, int, int]] = []
    ahead: list[tuple[int, int, int]] = []
    fault_ahead = HostPages.fault_ahead
    monkeypatch.setattr(HostPages, "pin", lambda pages, offset, n, *, fault=True:
                        pinned.append((pages.base, offset, n)))

    def record(pages: HostPages, ranges: list[tuple[int, int]]) -> None:
        ahead.extend((pages.base, o, n) for o, n in ranges)
        fault_ahead(pages, ranges)

    monkeypatch.setattr(HostPages, "fault_ahead", record)
    tier = PinnedKVStore()
    tier.is_pinned = True
    row = 4 * mmap.PAGESIZE  # a row of 16 KiB: a growth of r rows is 4 r pages a head
    rows = growable_rows(tier, (1, 2, 3, row // 4), torch.float32)
    rows.keys.fill_(1.0)
    assert ahead == [] and len(pinned) == 4  # a first registration: no growth to repeat
    head = 16 * 3 * row  # the reserve: 16 times the rows
    keys = rows.keys.data_ptr()
    rows = tier.extend(rows, 5)  # grew by 2 rows: the next 2 faulted in ahead
    assert sorted(a for a in ahead if a[0] == keys) == [(keys, 5 * row, 2 * row),
                                                        (keys, head + 5 * row, 2 * row)]
    ahead.clear()
    rows = tier.extend(rows, 47)  # 42 rows more: only 1 row is left in the reserve
    assert sorted(a for a in ahead if a[0] == keys) == [(keys, 47 * row, row),
                                                        (keys, head + 47 * row, row)]
    assert sorted(p[1:] for p in pinned if p[0] == keys) == [
        (0, 3 * row), (3 * row, 2 * row), (5 * row, 42 * row), (head, 3 * row),
        (head + 3 * row, 2 * row), (head + 5 * row, 42 * row)]
    assert float(rows.keys[:, :, :3].sum()) == 2 * 3 * row // 4  # kept through it all
    tier.free(rows)


def test_rows_placed_in_inference_mode_grow_in_place_outside_it():
    # a prompt prefilled under torch.inference_mode, then decoded under no_grad
    tier = PinnedKVStore()
    with torch.inference_mode():
        stack = growable_rows(tier, (2, 2, 10, 8), torch.float32)
        part = tier.split(stack)[0]
        plain = tier.allocate((2, 3, 8), torch.float32)
    assert not (part.keys.is_inference() or plain.keys.is_inference())
    with torch.no_grad():
        part = tier.extend(part, 12)
        part.keys[:, -2:] = 1.0
        plain.values.fill_(2.0)
    assert float(part.keys[:, 10:].sum()) == 2 * 2 * 8 and float(plain.values.sum()) == 96
    tier.free(part)
    tier.free(plain)
