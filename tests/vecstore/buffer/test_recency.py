"""The vectorised LRU/FIFO victim lists equal the per-row CachePolicy bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecstore.buffer import PolicyBookkeeper, StepRecord, bookkeeping


def _gpu_step(rng, victims, slot_of, owner, num_clusters, width):
    """What the GPU does in one step (as WaveBuffer): hits by the slot table, misses given
    the next usable slots of the current victim list; returns the step's record."""
    rows, num_slots = owner.shape
    rec = {k: np.full((rows, width), -1, dtype=np.int32)
           for k in ("ids", "slot", "admitted", "evicted")}
    count = np.zeros(rows, dtype=np.int32)
    for r in range(rows):
        n = int(rng.integers(0, width + 1))
        ids = np.sort(rng.choice(num_clusters, size=n, replace=False)).astype(np.int32)
        count[r] = n
        rec["ids"][r, :n] = ids
        rec["slot"][r, :n] = slot_of[r, ids]
        used = set(slot_of[r, ids][slot_of[r, ids] >= 0].tolist())
        usable = [int(s) for s in victims[r] if s not in used]
        for p in np.nonzero(slot_of[r, ids] < 0)[0]:
            if not usable:
                break
            a = usable.pop(0)
            old = owner[r, a]
            if old >= 0:
                slot_of[r, old] = -1
            rec["admitted"][r, p], rec["evicted"][r, p] = a, old
            owner[r, a], slot_of[r, ids[p]] = ids[p], a
    t = {k: torch.from_numpy(v) for k, v in rec.items()}
    return StepRecord(t["ids"], t["slot"], t["admitted"], t["evicted"],
                      torch.from_numpy(count), None)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), num_slots=st.integers(1, 8), num_clusters=st.integers(1, 20),
       steps=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_recency_order_equals_the_policies(policy, rows, num_slots, num_clusters, steps,
                                           seed):
    rng = np.random.default_rng(seed)
    fast = PolicyBookkeeper(rows, num_slots, policy)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(bookkeeping, "RECENCY", {})  # the per-row CachePolicy path
        slow = PolicyBookkeeper(rows, num_slots, policy)
    assert fast._recency is not None and slow._recency is None
    victims = np.tile(np.arange(num_slots, dtype=np.int32), (rows, 1))
    slot_of = np.full((rows, num_clusters), -1, dtype=np.int32)
    owner = np.full((rows, num_slots), -1, dtype=np.int32)
    width = min(num_clusters, 6)
    for _ in range(steps):
        rec = _gpu_step(rng, victims, slot_of, owner, num_clusters, width)
        fast.submit(rec).result()
        slow.submit(rec).result()
        got, want = fast.take_victims(), slow.take_victims()
        assert torch.equal(got, want)
        victims = got.numpy()
    fast.close()
    slow.close()


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), num_slots=st.integers(1, 10), steps=st.integers(1, 8),
       width=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_deferred_steps_fold_as_if_applied_in_turn(policy, rows, num_slots, steps, width,
                                                   seed):
    from vecstore.buffer.recency import RecencyOrder

    rng = np.random.default_rng(seed)
    records = []
    for _ in range(steps):
        # entries past a row's count are noise; a slot is used at most once a step
        slot = rng.integers(-1, num_slots, size=(rows, width)).astype(np.int32)
        admitted = rng.integers(-1, num_slots, size=(rows, width)).astype(np.int32)
        count = rng.integers(0, min(width, num_slots) + 1, size=rows)
        for r in range(rows):
            used = rng.permutation(num_slots)[:count[r]]
            hit = rng.random(count[r]) < 0.5
            slot[r, :count[r]] = np.where(hit, used, -1)
            admitted[r, :count[r]] = np.where(hit, -1, used)
        records.append((slot, admitted, count))
    in_turn, deferred = RecencyOrder(rows, num_slots, policy), RecencyOrder(rows, num_slots,
                                                                             policy)
    want = [in_turn.apply(*rec) for rec in records][-1]
    for rec in records[:-1]:
        deferred.defer(*rec)
    assert np.array_equal(deferred.apply(*records[-1]), want)
    assert np.array_equal(deferred.apply(*records[0]), in_turn.apply(*records[0]))
