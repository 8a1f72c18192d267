"""The wave buffer on simulated tiers (CPU tensors): hits, misses, admission, budgets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.interpreter import interpreted, request_interpreter
from vecstore.buffer import PolicyBookkeeper, StepRecord, WaveBuffer
from vecstore.cache import POLICIES
from vecstore.errors import CapacityError
from vecstore.executor.wave_exec import Zones
from vecstore.kvstore import MemoryAccount

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
    buf.fill_hits()
    buf.plan_admission()
    buf.wait_misses()
    buf.admit()
    buf.finish_step()
    buf.bookkeeper.wait()


def _expected_exec(zones, keys, row, cached):
    """The row's retrieved clusters' KV rows, hits (clusters in ``cached``) first, then
    misses, each in retrieved order."""
    n = int(zones.count[row])
    ids = zones.ids[row, :n].tolist()
    order = ([i for i in range(n) if ids[i] in cached]
             + [i for i in range(n) if ids[i] not in cached])
    parts = [keys[row, int(zones.first_row[row, i]):int(zones.first_row[row, i])
                  + int(zones.cum[row, i + 1] - zones.cum[row, i])] for i in order]
    return torch.cat(parts)


@pytest.mark.parametrize("lookup_block", [1024, 2])  # 2: the lookup loops over a row
@interpreted
def test_execution_buffer_cache_and_admission(monkeypatch, lookup_block):
    from vecstore.executor import wave_cache

    monkeypatch.setattr(wave_cache, "_LOOKUP_BLOCK", lookup_block)
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
            assert torch.equal(buf.exec_k[r, :total], _expected_exec(zones, keys, r, cached[r]))
            assert torch.equal(buf.exec_v[r, :total],
                               _expected_exec(zones, values, r, cached[r]))
            # every resident cluster's slot holds its rows, and the tables agree
            for c in (buf.slot_of[r, :C] >= 0).nonzero().flatten().tolist():
                s, n = int(buf.slot_of[r, c]), int(sizes[r, c])
                assert int(buf.owner[r, s]) == c and n <= 12
                assert torch.equal(buf.cache_k[r, s * 12:s * 12 + n],
                                   keys[r, first[r, c]:first[r, c] + n])
            assert int((buf.slot_of[r, :C] >= 0).sum()) <= 4
            assert int(buf.slot_of[r, 0]) == -1  # the oversized cluster is never cached
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


def _admission_reference(slot, size, ids, count, victims, consumed, owner, slot_of, tokens):
    """The admission rules row by row in plain Python: misses that fit a slot take, in
    retrieved order, the victim positions not yet consumed whose slot no hit holds."""
    rows, width = slot.shape
    admitted = np.full((rows, width), -1, dtype=np.int32)
    evicted = np.full((rows, width), -1, dtype=np.int32)
    for r in range(rows):
        n = int(count[r])
        held = {int(s) for s in slot[r, :n] if s >= 0}
        usable = [j for j in range(victims.shape[1])
                  if not consumed[r, j] and int(victims[r, j]) not in held]
        misses = [i for i in range(n) if slot[r, i] < 0 and size[r, i] <= tokens]
        for k, i in enumerate(misses[:len(usable)]):
            a = int(victims[r, usable[k]])
            old = int(owner[r, a])
            if old >= 0:
                slot_of[r, old] = -1
            owner[r, a], slot_of[r, ids[r, i]] = ids[r, i], a
            admitted[r, i], evicted[r, i] = a, old
        consumed[r, usable[:min(len(misses), len(usable))]] = True
    return admitted, evicted


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), num_clusters=st.integers(1, 40), num_slots=st.integers(1, 12),
       width=st.integers(1, 10), tokens=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
@interpreted
def test_plan_admission_follows_the_rules(rows, num_clusters, num_slots, width, tokens, seed):
    from vecstore.executor.wave_cache import plan_admission

    rng = np.random.default_rng(seed)
    width = min(width, num_clusters)
    owner = np.full((rows, num_slots + 1), -1, dtype=np.int32)
    slot_of = np.full((rows, num_clusters + 1), -1, dtype=np.int32)
    victims = np.stack([rng.permutation(num_slots) for _ in range(rows)]).astype(np.int32)
    consumed = rng.random((rows, num_slots)) < 0.3
    z = Zones.empty(rows, num_clusters, width, torch.device("cpu"))
    slot = np.full((rows, width), -1, dtype=np.int32)
    size = rng.integers(1, 2 * tokens + 1, size=(rows, width)).astype(np.int32)
    for r in range(rows):
        cached = rng.choice(num_clusters, size=min(num_slots, num_clusters), replace=False)
        for s, c in zip(rng.permutation(num_slots), cached, strict=False):
            if rng.random() < 0.7:
                owner[r, s], slot_of[r, c] = c, s
        n = int(rng.integers(0, width + 1))
        ids = np.sort(rng.choice(num_clusters, size=n, replace=False))
        z.ids[r] = -1
        z.ids[r, :n] = torch.from_numpy(ids.astype(np.int32))
        z.count[r] = n
        z.cum[r] = torch.from_numpy(np.concatenate([[0], np.cumsum(size[r])]).astype(np.int32))
        slot[r, :n] = slot_of[r, ids]
    want_owner, want_slot_of, want_consumed = owner.copy(), slot_of.copy(), consumed.copy()
    want = _admission_reference(slot, size, z.ids.numpy(), z.count.numpy(), victims,
                                want_consumed, want_owner, want_slot_of, tokens)
    got = [torch.from_numpy(a.copy()) for a in (slot, victims, consumed, owner, slot_of)]
    admitted = torch.empty(rows, width, dtype=torch.int32)
    evicted = torch.empty(rows, width, dtype=torch.int32)
    plan_admission(z, *got, admitted, evicted, tokens)
    assert np.array_equal(admitted.numpy(), want[0])
    assert np.array_equal(evicted.numpy(), want[1])
    assert np.array_equal(got[2].numpy(), want_consumed)
    assert np.array_equal(got[3].numpy(), want_owner)
    assert np.array_equal(got[4].numpy(), want_slot_of)
