"""Replacement policies: exact match with the reference models of ``policy_models.py``,
the CachePolicy contract, and behaviour."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from tests.vecstore.cache.policy_models import (
    RefARC,
    RefClock,
    RefFIFO,
    RefLFU,
    RefLRU,
    RefS3FIFO,
)
from vecstore.cache import POLICIES, CachePolicy, make_policy
from vecstore.errors import CapacityError, ConfigError, InvalidValueError, NotFoundError

STATEFUL = settings(max_examples=40, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
NUM_KEYS = 10
KEYS = st.integers(0, NUM_KEYS - 1)
# a bit mask over the keys, so that sweeps often meet protected keys
PROTECTED = st.integers(0, 2**NUM_KEYS - 1).map(
    lambda mask: frozenset(k for k in range(NUM_KEYS) if mask >> k & 1))


class Driver:
    """Applies operations to a policy, checking the contract and, if given, a reference."""

    def __init__(self, name: str, capacity: int, reference: Callable[[int], Any] | None):
        self.policy = make_policy(name, capacity)
        self.ref = reference(capacity) if reference else None
        self.resident: set[Hashable] = set()

    def admit(self, key: int, protected: frozenset[int]) -> None:
        if key in self.resident:
            with pytest.raises(InvalidValueError, match="already resident"):
                self.policy.admit(key, protected=protected)
            return
        is_full = len(self.resident) >= self.policy.capacity
        if is_full and self.resident <= protected:
            before = self.policy.keys()
            with pytest.raises(CapacityError, match="protected"):
                self.policy.admit(key, protected=protected)
            assert self.policy.keys() == before
            return
        evicted = self.policy.admit(key, protected=protected)
        assert len(evicted) == int(is_full)
        assert set(evicted) <= self.resident - protected
        self.resident.difference_update(evicted)
        self.resident.add(key)
        if self.ref is not None:
            assert evicted == self.ref.admit(key, protected)

    def touch(self, key: int) -> None:
        if key not in self.resident:
            with pytest.raises(NotFoundError, match="not resident"):
                self.policy.touch(key)
            return
        self.policy.touch(key)
        if self.ref is not None:
            self.ref.touch(key)

    def discard(self, key: int) -> None:
        self.policy.discard(key)
        self.resident.discard(key)
        if self.ref is not None:
            self.ref.discard(key)

    def check(self) -> None:
        keys = self.policy.keys()
        assert len(keys) == len(set(keys)) == len(self.policy) <= self.policy.capacity
        assert set(keys) == self.resident
        assert all(k in self.policy for k in self.resident)
        assert not any(k in self.policy for k in set(range(4 * NUM_KEYS)) - self.resident)
        if self.ref is not None:
            assert keys == self.ref.keys()


class PolicyMachine(RuleBasedStateMachine):
    """Random admits (with protected keys), hits and discards on one policy."""

    policy_name = "lru"
    reference: Callable[[int], Any] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.driver: Driver | None = None

    @initialize(capacity=st.integers(1, 6))
    def build(self, capacity: int) -> None:
        self.driver = Driver(self.policy_name, capacity, self.reference)

    @rule(key=KEYS, protected=PROTECTED)
    def admit(self, key: int, protected: frozenset[int]) -> None:
        assert self.driver is not None
        self.driver.admit(key, protected)

    @rule(key=KEYS)
    def touch(self, key: int) -> None:
        assert self.driver is not None
        self.driver.touch(key)

    @rule(key=KEYS)
    def discard(self, key: int) -> None:
        assert self.driver is not None
        self.driver.discard(key)

    @invariant()
    def consistent(self) -> None:
        if self.driver is not None:
            self.driver.check()


def machine(name: str, reference: Callable[[int], Any] | None = None) -> type[PolicyMachine]:
    """A state machine class for policy ``name``, checked against ``reference`` if given."""
    return type(f"{name.upper()}Machine", (PolicyMachine,),
                {"policy_name": name, "reference": reference})


REFERENCES = [("lru", RefLRU), ("fifo", RefFIFO), ("lfu", RefLFU), ("clock", RefClock),
              ("arc", RefARC), ("s3fifo", RefS3FIFO)]


@pytest.mark.parametrize("name", POLICIES.names())
def test_contract(name: str) -> None:
    run_state_machine_as_test(machine(name), settings=STATEFUL)


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


@pytest.mark.parametrize("name", POLICIES.names())
def test_is_a_cache_policy(name: str) -> None:
    policy = make_policy(name, 3)
    assert isinstance(policy, CachePolicy)
    assert (policy.capacity, len(policy), policy.keys()) == (3, 0, [])
    policy.discard("absent")


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ConfigError, match=r"'lru'.*did you mean 'lru'"):
        make_policy("lur", 4)


@pytest.mark.parametrize("name", POLICIES.names())
@pytest.mark.parametrize("capacity", [0, -1, 2.5, True, "4"])
def test_bad_capacity(name: str, capacity: Any) -> None:
    with pytest.raises(InvalidValueError, match="capacity"):
        make_policy(name, capacity)


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
