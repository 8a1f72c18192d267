"""Replacement policies: exact match with the reference models of ``policy_models.py``, and
behaviour; the contract every registered policy keeps is in
``tests/contracts/test_policy_contract.py``."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from tests.vecstore.policies.policy_driver import NUM_KEYS, STATEFUL, Driver, machine
from tests.vecstore.policies.policy_models import (
    RefARC,
    RefClock,
    RefFIFO,
    RefLFU,
    RefLRU,
    RefS3FIFO,
)
from vecstore.errors import ConfigError
from vecstore.policies import POLICIES, make_policy

REFERENCES = [("lru", RefLRU), ("fifo", RefFIFO), ("lfu", RefLFU), ("clock", RefClock),
              ("arc", RefARC), ("s3fifo", RefS3FIFO)]


@pytest.mark.parametrize("name, reference", REFERENCES)
def test_matches_reference(name: str, reference: Callable[[int], Any]) -> None:
    run_state_machine_as_test(machine(name, reference), settings=STATEFUL)


def random_trace(seed: int, num_keys: int, length: int = 400) -> list[tuple[str, int, frozenset]]:
    """Long traces with skewed keys reach deep states (full ghost lists, saturated counts)
    that short state-machine runs rarely do; some traces protect and discard nothing."""
    rng = random.Random(seed)
    p_protect = rng.choice([0.0, 0.25, 0.5])
    ops = ["admit", "admit", "touch", "touch"] + ["discard"] * rng.choice([0, 1])
    keys = [0, 0, 0, 1, 1, 2, *range(num_keys)]
    return [(rng.choice(ops), rng.choice(keys),
             frozenset(k for k in range(num_keys) if rng.random() < p_protect))
            for _ in range(length)]


@pytest.mark.parametrize("name, reference", REFERENCES)
@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(1, 7) | st.integers(20, 24), seed=st.integers(0, 2**32 - 1))
def test_long_traces_match_reference(name: str, reference: Callable[[int], Any],
                                     capacity: int, seed: int) -> None:
    """Capacities from 20 give S3-FIFO a small queue of two keys."""
    driver = Driver(name, capacity, reference)
    for op, key, protected in random_trace(seed, num_keys=max(NUM_KEYS, capacity * 3 // 2)):
        if op == "admit":
            driver.admit(key, protected)
        else:
            getattr(driver, op)(key)
        driver.check()


def test_registry_names() -> None:
    assert POLICIES.names() == ["arc", "clock", "fifo", "lfu", "lru", "s3fifo"]


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ConfigError, match=r"'lru'.*did you mean 'lru'"):
        make_policy("lur", 4)


def _scan(name: str) -> set[Hashable]:
    """Keys 0-4 are each hit three times, then 100 one-off keys stream through."""
    policy = make_policy(name, 10)
    for k in range(5):
        policy.admit(k)
    for _ in range(3):
        for k in range(5):
            policy.touch(k)
    for k in range(100, 200):
        policy.admit(k)
    return set(policy.keys())


@pytest.mark.parametrize("name", ["arc", "s3fifo", "lfu"])
def test_reused_keys_survive_a_scan(name: str) -> None:
    assert set(range(5)) <= _scan(name)


@pytest.mark.parametrize("name", ["lru", "fifo", "clock"])
def test_recency_policies_are_flushed_by_a_scan(name: str) -> None:
    assert not set(range(5)) & _scan(name)


def test_s3fifo_ghost_hit_enters_main() -> None:
    policy = make_policy("s3fifo", 10)
    for k in range(10):
        policy.admit(k)
    assert policy.admit(10) == [0]  # 0 was never hit: out, remembered as a ghost
    assert policy.admit(0) == [1]
    assert policy.keys()[-1] == 0  # the main queue is listed last


def test_s3fifo_counts_saturate_at_three() -> None:
    policy = make_policy("s3fifo", 2)  # S and M hold one key each
    policy.admit("a")
    policy.touch("a")
    policy.admit("b")
    assert policy.admit("x0") == ["b"]  # "a" was hit on probation: promoted to M
    for _ in range(5):
        policy.touch("a")  # counts 3, not 5
    evicted = []
    for i in range(4):  # each promotion overflows M, whose hand passes "a" once
        policy.touch(f"x{i}")
        evicted += policy.admit(f"x{i + 1}")
    assert evicted == ["x0", "x1", "x2", "a"]


def test_s3fifo_evicts_from_small_when_main_is_all_protected() -> None:
    policy = make_policy("s3fifo", 20)  # S holds 2 keys, M 18
    for k in range(20):
        policy.admit(k)
    for k in range(19):
        policy.touch(k)
    assert policy.admit(20) == [0]  # 0-18 move to M, which overflows by one
    assert policy.admit(21) == [19]  # never hit: from S into the ghost queue
    policy.discard(21)
    assert policy.admit(19) == []  # ghost hit: straight into M; S holds 20 alone
    assert policy.admit(22, protected=set(range(1, 20))) == [20]
