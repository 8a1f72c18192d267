"""The wave buffer on simulated tiers (CPU tensors): hits, misses, admission, budgets."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreted, request_interpreter
from vecstore.buffer import PolicyBookkeeper, StepRecord, WaveBuffer
from vecstore.buffer.cache_fill import can_take_over, take_over, warm
from vecstore.errors import CapacityError, InvalidValueError
from vecstore.kernels.zones import Zones
from vecstore.kvstore import MemoryAccount
from vecstore.policies import POLICIES

ROWS, C, D = 2, 40, 16


request_interpreter()  # the kernels run on CPU tensors in Triton's interpreter


def _layout(gen):
    sizes = torch.randint(1, 12, (ROWS, C), generator=gen, dtype=torch.int32)
    sizes[:, 0] = 20  # larger than a slot: never cached
    first = (torch.cumsum(sizes, 1) - sizes).int()
    n = int(sizes.sum(1).max())
    keys = torch.randn(ROWS, n, D, generator=gen)
    return sizes, first, keys, torch.randn(ROWS, n, D, generator=gen)


def _zones(ids_per_row, sizes, first, r_max):
    z = Zones.empty(ROWS, C, r_max, torch.device("cpu"))
    z.zone.zero_()
    for r, ids in enumerate(ids_per_row):
        ids = sorted(ids)
        n = len(ids)
        z.ids[r, :n] = torch.tensor(ids, dtype=torch.int32)
        z.first_row[r, :n] = first[r, ids]
        z.cum[r, : n + 1] = torch.tensor([0, *torch.cumsum(sizes[r, ids], 0).tolist()])
        z.count[r] = n
    return z


def _step(buf, zones):
    buf.begin_step()
    buf.lookup(zones)
    buf.fill_misses()
    buf.map_hits()
    buf.plan_admission()
    buf.wait_misses()
    buf.admit()
    buf.finish_step()
    buf.bookkeeper.wait()


def _served(buf, row, total, *, values=False):
    """The rows a step's retrieved attention reads for ``row``: its hits in their cache
    slots through the hit map (positions ``0:split``), then its misses in the execution
    buffer."""
    cache, exec_rows = (buf.cache_v, buf.exec_v) if values else (buf.cache_k, buf.exec_k)
    split = int(buf.layout.split[row])
    return torch.cat([cache[row, buf.hit_map[row, :split].long()], exec_rows[row, split:total]])


def _expected_served(zones, keys, row, cached):
    """The row's retrieved clusters' KV rows, hits (clusters in ``cached``) first, then
    misses, each in retrieved order."""
    n = int(zones.count[row])
    ids = zones.ids[row, :n].tolist()
    order = ([i for i in range(n) if ids[i] in cached]
             + [i for i in range(n) if ids[i] not in cached])
    parts = [keys[row, int(zones.first_row[row, i]):int(zones.first_row[row, i])
                  + int(zones.cum[row, i + 1] - zones.cum[row, i])] for i in order]
    return torch.cat(parts)


def _check_slots(buf, sizes, first, keys, values, slot_tokens=12):
    """Every resident cluster's slot holds its rows, the tables agree, no slot holds a
    cluster larger than a slot."""
    for r in range(ROWS):
        for c in (buf.slot_of[r, :C] >= 0).nonzero().flatten().tolist():
            s, n = int(buf.slot_of[r, c]), int(sizes[r, c])
            assert int(buf.owner[r, s]) == c and n <= slot_tokens
            at = slice(s * slot_tokens, s * slot_tokens + n)
            assert torch.equal(buf.cache_k[r, at], keys[r, first[r, c]:first[r, c] + n])
            assert torch.equal(buf.cache_v[r, at], values[r, first[r, c]:first[r, c] + n])
        held = (buf.owner[r, :buf.num_slots] >= 0).nonzero().flatten().tolist()
        assert len(held) == int((buf.slot_of[r, :C] >= 0).sum())
    assert (buf.slot_of[:, C] == -1).all() and (buf.owner[:, buf.num_slots] == -1).all()


@pytest.mark.parametrize("lookup_block", [1024, 2])  # 2: the lookup loops over a row
@interpreted
def test_execution_buffer_cache_and_admission(monkeypatch, lookup_block):
    from vecstore.kernels import slot_table

    monkeypatch.setattr(slot_table, "_LOOKUP_BLOCK", lookup_block)
    gen = torch.Generator().manual_seed(0)
    sizes, first, keys, values = _layout(gen)
    buf = WaveBuffer(keys, values, num_clusters=C, r_max=6, exec_rows=6 * 20, num_slots=4,
                     slot_tokens=12, device=torch.device("cpu"), policy="lru")
    steps = [[[0, 3, 5, 7], [1, 2]], [[3, 5, 9], [2, 4, 6, 8, 10, 12]], [[0, 3, 5], [1, 2]]]
    for ids in steps:
        zones = _zones(ids, sizes, first, 6)
        cached = [set((buf.slot_of[r, :C] >= 0).nonzero().flatten().tolist())
                  for r in range(ROWS)]
        _step(buf, zones)
        for r in range(ROWS):
            total = int(zones.cum[r, zones.count[r]])
            hit_rows = sum(int(sizes[r, c]) for c in ids[r] if c in cached[r])
            assert int(buf.layout.split[r]) == hit_rows
            assert torch.equal(_served(buf, r, total), _expected_served(zones, keys, r, cached[r]))
            assert torch.equal(_served(buf, r, total, values=True),
                               _expected_served(zones, values, r, cached[r]))
            assert int((buf.slot_of[r, :C] >= 0).sum()) <= 4
            assert int(buf.slot_of[r, 0]) == -1  # the oversized cluster is never cached
        _check_slots(buf, sizes, first, keys, values)
    st = buf.stats
    assert st.hits + st.misses == sum(len(i) for step in steps for i in step)
    assert st.hit_rows + st.miss_rows == sum(int(sizes[r, c]) for step in steps
                                             for r, ids in enumerate(step) for c in ids)
    # step 2: 3, 5 and 2 hit; step 3: 3, 5 and 2 again (1 was evicted for 4, 6, 8; 0 is
    # too large to cache)
    assert st.hits == 6
    assert st.hit_rows == sum(int(sizes[r, c]) for r, ids in enumerate([[3, 5], [2]])
                              for c in ids) * 2
    buf.close()


def test_gpu_budget_too_small_fails_before_allocating():
    acct = MemoryAccount(1000, "gpu")
    keys = torch.zeros(ROWS, 100, D)
    with pytest.raises(CapacityError, match="budget"):
        WaveBuffer(keys, keys, num_clusters=C, r_max=4, exec_rows=40, num_slots=4,
                   slot_tokens=8, device=torch.device("cpu"), account=acct)
    assert acct.used_bytes == 0


@pytest.mark.parametrize("policy", POLICIES.names())
def test_bookkeeper_publishes_a_permutation_of_slots(policy):
    bk = PolicyBookkeeper(1, 3, policy)

    def t(*v):
        return torch.tensor([list(v)], dtype=torch.int32)

    bk.submit(StepRecord(t(4, 5, 6), t(-1, -1, -1), t(0, 1, 2), t(-1, -1, -1),
                         torch.tensor([3]), None))
    bk.submit(StepRecord(t(4, 9, 0), t(0, -1, -1), t(-1, 1, -1), t(-1, 5, -1),
                         torch.tensor([2]), None))
    bk.wait()
    victims = bk.take_victims()
    assert sorted(victims[0].tolist()) == [0, 1, 2]
    assert bk.take_victims() is None  # taken once
    assert bk.applied == 2 and bk.lag == 0
    bk.close()
    bk.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])  # a recency order, and per-row policies
@interpreted
def test_warm_places_the_newest_cacheable_clusters_in_free_slots(policy):
    gen = torch.Generator().manual_seed(3)
    sizes, first, keys, values = _layout(gen)
    sizes[0, 36:] = 30  # row 0's four newest are too large for a slot: the next four go
    first = (torch.cumsum(sizes, 1) - sizes).int()
    n = int(sizes.sum(1).max())
    keys, values = torch.randn(ROWS, n, D, generator=gen), torch.randn(ROWS, n, D, generator=gen)
    buf = WaveBuffer(keys, values, num_clusters=C, r_max=6, exec_rows=6 * 30, num_slots=4,
                     slot_tokens=12, device=torch.device("cpu"), policy=policy)
    assert warm(buf, sizes, first) == 8
    cached = [sorted((buf.slot_of[r, :C] >= 0).nonzero().flatten().tolist())
              for r in range(ROWS)]
    assert cached == [[32, 33, 34, 35], [36, 37, 38, 39]]
    _check_slots(buf, sizes, first, keys, values)
    # oldest placed first in the victim list, the same on the device and from the policy
    for r in range(ROWS):
        assert buf.owner[r, buf.victims[r].long()].tolist() == cached[r]
    buf.bookkeeper.wait()
    published = buf.bookkeeper.take_victims()
    assert torch.equal(published, buf.victims.cpu())
    assert warm(buf, sizes, first) == 0  # nothing free: nothing moves
    assert buf.stats.hits == buf.stats.misses == 0  # placing is neither
    # a step over placed clusters hits, and its rows are the clusters' own
    zones = _zones([[33, 35, 2], [39, 1]], sizes, first, 6)
    _step(buf, zones)
    assert (buf.stats.hits, buf.stats.misses) == (3, 2)
    for r in range(ROWS):
        hits = [c for c in ([33, 35, 2], [39, 1])[r] if c in cached[r]]
        total = int(zones.cum[r, zones.count[r]])
        assert torch.equal(_served(buf, r, total), _expected_served(zones, keys, r, set(hits)))
    _check_slots(buf, sizes, first, keys, values)
    buf.close()


@interpreted
def test_warm_fills_only_free_slots_and_keeps_what_is_cached():
    gen = torch.Generator().manual_seed(4)
    sizes, first, keys, values = _layout(gen)
    buf = WaveBuffer(keys, values, num_clusters=C, r_max=6, exec_rows=6 * 20, num_slots=6,
                     slot_tokens=12, device=torch.device("cpu"), policy="lru")
    _step(buf, _zones([[3, 5], [7]], sizes, first, 6))  # admitted by a step: 3, 5 and 7
    assert warm(buf, sizes, first) == 4 + 5
    for r, kept in enumerate(([3, 5], [7])):
        cached = sorted((buf.slot_of[r, :C] >= 0).nonzero().flatten().tolist())
        newest = [c for c in range(C - 1, -1, -1) if c not in kept and sizes[r, c] <= 12]
        assert cached == sorted(kept + newest[:6 - len(kept)])
        # the step's clusters are evicted before the placed ones, the oldest placed first
        order = buf.owner[r, buf.victims[r].long()].tolist()
        assert order == kept + sorted(newest[:6 - len(kept)])
    _check_slots(buf, sizes, first, keys, values)
    buf.bookkeeper.wait()
    assert torch.equal(buf.bookkeeper.take_victims(), buf.victims.cpu())
    buf.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_lagging_worker_publishes_only_the_newest_victim_list(policy):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    def t(*v):
        return torch.tensor([list(v)], dtype=torch.int32)

    records = [StepRecord(t(4, 5, 6), t(-1, -1, -1), t(0, 1, 2), t(-1, -1, -1),
                          torch.tensor([3]), None),
               StepRecord(t(4, 9, 0), t(0, -1, -1), t(-1, 1, -1), t(-1, 5, -1),
                          torch.tensor([2]), None),
               StepRecord(t(6, 7, 0), t(2, -1, -1), t(-1, 0, -1), t(-1, 4, -1),
                          torch.tensor([2]), None)]
    steady = PolicyBookkeeper(1, 3, policy)
    for rec in records:  # applied one at a time: each list published
        steady.submit(rec).result()
    assert steady.published == 3
    worker = ThreadPoolExecutor(1)
    gate = threading.Event()
    worker.submit(gate.wait)  # the worker is busy while the three records queue up
    lagging = PolicyBookkeeper(1, 3, policy, executor=worker)
    for rec in records:
        lagging.submit(rec)
    gate.set()
    lagging.wait()
    assert lagging.applied == 3 and lagging.published == 1
    assert torch.equal(lagging.take_victims(), steady.take_victims())
    steady.close()
    worker.shutdown()


@interpreted
def test_take_over_keeps_the_old_caches_clusters_in_a_grown_buffer():
    # the old buffer serves the first 30 clusters of the rows; the new one the same rows
    # with 10 clusters appended (a segment flush), with more slots
    gen = torch.Generator().manual_seed(5)
    sizes, first, keys, values = _layout(gen)
    old = WaveBuffer(keys, values, num_clusters=30, r_max=6, exec_rows=6 * 20, num_slots=4,
                     slot_tokens=12, device=torch.device("cpu"), policy="lru")
    for ids in ([[3, 5, 7], [1, 2]], [[3, 9], [4, 6, 8]]):
        _step(old, _zones(ids, sizes, first, 6))
    held = [sorted((old.slot_of[r, :30] >= 0).nonzero().flatten().tolist())
            for r in range(ROWS)]
    order = [old.owner[r, old.victims[r].long()].tolist() for r in range(ROWS)]
    new = WaveBuffer(keys, values, num_clusters=C, r_max=6, exec_rows=6 * 20, num_slots=6,
                     slot_tokens=12, device=torch.device("cpu"), policy="lru")
    assert can_take_over(new, old) and not can_take_over(old, new)
    take_over(new, old)
    old.close()
    for r in range(ROWS):
        assert sorted((new.slot_of[r, :C] >= 0).nonzero().flatten().tolist()) == held[r]
        # the two slots added are evicted first, then the old ones in the old order
        assert new.victims[r, :2].tolist() == [4, 5]
        assert new.owner[r, new.victims[r, 2:].long()].tolist() == order[r]
    _check_slots(new, sizes, first, keys, values)
    assert new.stats == old.stats  # the counters carry on
    # the next step hits what the old buffer held, and a warm then fills only the new slots
    zones = _zones([[3, 5, 39], [2, 8]], sizes, first, 6)
    before = new.stats
    _step(new, zones)
    hits = [[c for c in ids if c in held[r]] for r, ids in enumerate(([3, 5, 39], [2, 8]))]
    assert new.stats.hits - before.hits == sum(map(len, hits))
    for r in range(ROWS):
        total = int(zones.cum[r, zones.count[r]])
        assert torch.equal(_served(new, r, total),
                           _expected_served(zones, keys, r, set(hits[r])))
    _check_slots(new, sizes, first, keys, values)
    new.close()


def test_take_over_refuses_a_buffer_it_cannot_hold():
    keys = torch.zeros(ROWS, 100, D)
    small = WaveBuffer(keys, keys, num_clusters=C, r_max=4, exec_rows=40, num_slots=4,
                       slot_tokens=8, device=torch.device("cpu"))
    other = WaveBuffer(keys, keys, num_clusters=C, r_max=4, exec_rows=40, num_slots=4,
                       slot_tokens=16, device=torch.device("cpu"))
    with pytest.raises(InvalidValueError, match="cannot pass its cache"):
        take_over(small, other)
    assert (small.slot_of == -1).all()  # nothing changed
    small.close()
    other.close()
