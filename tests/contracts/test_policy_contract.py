"""The :class:`~vecstore.policies.CachePolicy` contract, for every policy in ``POLICIES``.

A policy registered later is checked here with no edit. Besides random operations against
the contract (``policy_driver.py``), each policy is driven the two ways a block cache drives
one, one decode step of distinct clusters at a time: protecting the step's clusters while it
admits their misses, and as the GPU wave buffer does (the GPU evicts the first key of
``keys()`` that the step does not use, then the policy is told with ``discard`` and
``admit``, which must evict nothing more).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from tests.vecstore.policies.policy_driver import STATEFUL, machine
from vecstore.errors import CapacityError, InvalidValueError
from vecstore.policies import POLICIES, CachePolicy, make_policy

NAMES = POLICIES.names()
STEPS = st.lists(st.lists(st.integers(0, 11), unique=True, max_size=8), min_size=1, max_size=12)


@pytest.mark.parametrize("name", NAMES)
def test_is_an_empty_cache_policy(name: str) -> None:
    policy = make_policy(name, 3)
    assert isinstance(policy, CachePolicy)
    assert (policy.capacity, len(policy), policy.keys()) == (3, 0, [])
    policy.discard("absent")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("capacity", [0, -1, 2.5, True, "4"])
def test_bad_capacity(name: str, capacity: Any) -> None:
    with pytest.raises(InvalidValueError, match="capacity: expected an integer >= 1"):
        make_policy(name, capacity)


@pytest.mark.parametrize("name", NAMES)
def test_random_operations_keep_the_contract(name: str) -> None:
    run_state_machine_as_test(machine(name), settings=STATEFUL)


@pytest.mark.parametrize("name", NAMES)
@given(capacity=st.integers(1, 8), steps=STEPS)
def test_a_step_never_evicts_its_own_clusters(name: str, capacity: int,
                                              steps: list[list[int]]) -> None:
    """Hits are touched, then misses admitted with the whole step protected; a miss that
    finds every slot held by the step is refused with nothing changed."""
    policy = make_policy(name, capacity)
    resident: set[int] = set()
    for step in steps:
        in_use = frozenset(step)
        for c in step:
            if c in resident:
                policy.touch(c)
        for c in (c for c in step if c not in resident):
            if len(resident) == capacity and resident <= in_use:
                before = policy.keys()
                with pytest.raises(CapacityError, match="every resident key is protected"):
                    policy.admit(c, protected=in_use)
                assert policy.keys() == before
                continue
            evicted = policy.admit(c, protected=in_use)
            assert len(evicted) == (len(resident) == capacity)
            assert set(evicted) <= resident - in_use
            resident = (resident - set(evicted)) | {c}
        assert len(resident & in_use) == min(len(step), capacity)
        assert sorted(policy.keys()) == sorted(resident) and len(policy) <= capacity


@pytest.mark.parametrize("name", NAMES)
@given(capacity=st.integers(1, 8), steps=STEPS)
def test_a_slot_freed_by_the_gpu_is_refilled_without_eviction(
        name: str, capacity: int, steps: list[list[int]]) -> None:
    policy = make_policy(name, capacity)
    for step in steps:
        for c in step:
            if c in policy:
                policy.touch(c)
                continue
            if len(policy) == capacity:
                victims = [k for k in policy.keys() if k not in step]
                if not victims:
                    continue  # every slot holds a cluster of this step: not cached
                policy.discard(victims[0])
                assert victims[0] not in policy
            assert policy.admit(c) == []
        keys = policy.keys()
        assert len(keys) == len(set(keys)) == len(policy) <= capacity
        assert all(k in policy for k in keys)
