"""Drives a replacement policy through admits, hits and discards, checking the
:class:`~vecstore.policies.CachePolicy` contract at every step and, if given, a reference model
(``policy_models.py``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vecstore.errors import CapacityError, InvalidValueError, NotFoundError
from vecstore.policies import make_policy

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
