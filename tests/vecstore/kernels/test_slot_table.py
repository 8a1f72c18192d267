"""The slot table's admission kernel against the admission rules written in plain Python
(the lookup and the copies are tested through the wave buffer, tests/vecstore/buffer)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.interpreter import interpreted, request_interpreter
from vecstore.kernels.slot_scratch import AdmissionScratch
from vecstore.kernels.slot_table import plan_admission
from vecstore.kernels.zones import Zones

request_interpreter()  # the kernels run on CPU tensors in Triton's interpreter


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
    # a scratch kept across launches, as a wave buffer keeps it: the first launch over a
    # copy of the inputs must leave it as it found it (zeroed marks) for the second
    scratch = AdmissionScratch.empty(rows, num_slots, torch.device("cpu"))
    for _ in range(2):
        got = [torch.from_numpy(a.copy()) for a in (slot, victims, consumed, owner, slot_of)]
        admitted = torch.empty(rows, width, dtype=torch.int32)
        evicted = torch.empty(rows, width, dtype=torch.int32)
        plan_admission(z, *got, admitted, evicted, tokens, scratch)
        assert not scratch.mark.any()
        assert np.array_equal(admitted.numpy(), want[0])
        assert np.array_equal(evicted.numpy(), want[1])
        assert np.array_equal(got[2].numpy(), want_consumed)
        assert np.array_equal(got[3].numpy(), want_owner)
        assert np.array_equal(got[4].numpy(), want_slot_of)
