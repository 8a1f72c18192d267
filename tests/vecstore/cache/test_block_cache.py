"""BlockCache: slots against a model, same-step protection, async == sync, input checks."""

from __future__ import annotations

import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecstore.cache import POLICIES, BlockCache, CachePolicy, Lookup, LRUPolicy, make_policy
from vecstore.errors import ConfigError, InvalidValueError, ShapeError

CLUSTERS = st.lists(st.integers(0, 9), unique=True, max_size=6)
STEP = st.dictionaries(
    st.tuples(st.integers(0, 1), st.integers(0, 2)),
    st.one_of(CLUSTERS, CLUSTERS.map(lambda c: torch.tensor(c, dtype=torch.int64)),
              CLUSTERS.map(lambda c: torch.tensor(c, dtype=torch.int32))),
    max_size=4,
)
STEPS = st.lists(STEP, min_size=1, max_size=12)
SETTINGS = settings(max_examples=40, deadline=None)


def _ids(clusters: Any) -> list[int]:
    return clusters.tolist() if isinstance(clusters, torch.Tensor) else list(clusters)


@pytest.mark.parametrize("name", POLICIES.names())
@SETTINGS
@given(num_slots=st.integers(1, 8), steps=STEPS)
def test_slots_match_a_model(name: str, num_slots: int, steps: list[dict]) -> None:
    cache = BlockCache(num_slots, policy=name)
    model: dict[tuple[int, int, int], int] = {}  # resident key -> slot
    shadow = make_policy(name, num_slots)  # fed the bookkeeping the docs promise
    num_requests = num_evicted = 0
    for step in steps:
        step_keys = {(s, h, c) for (s, h), ids in step.items() for c in _ids(ids)}
        lookup = cache.lookup(step)
        assert list(lookup.heads) == list(step)
        for (s, h), ids in step.items():
            got, ids = lookup.heads[(s, h)], _ids(ids)
            hits = [c for c in ids if (s, h, c) in model]
            assert got.hit_clusters.tolist() == hits
            assert got.hit_slots.tolist() == [model[(s, h, c)] for c in hits]
            assert got.miss_clusters.tolist() == [c for c in ids if (s, h, c) not in model]
        admission = cache.admit(lookup)
        _replay(shadow, lookup, admission, step_keys)
        for key in admission.evicted:
            assert key not in step_keys  # same-step protection
            del model[key]
        for (s, h), got in admission.heads.items():
            misses = lookup.heads[(s, h)].miss_clusters.tolist()
            assert got.clusters.tolist() + got.rejected.tolist() == misses
            model.update({(s, h, c): slot for c, slot in
                          zip(got.clusters.tolist(), got.slots.tolist(), strict=True)})
        if any(len(got.rejected) for got in admission.heads.values()):
            assert len(model) == num_slots and set(model) <= step_keys
        else:
            assert step_keys <= set(model)
        assert len(model) == len(set(model.values())) == len(cache) <= num_slots
        assert all(0 <= slot < num_slots for slot in model.values())
        assert set(cache.policy.keys()) == set(model)
        num_requests += len(step_keys)
        num_evicted += len(admission.evicted)
    stats = cache.stats
    assert stats.hits + stats.misses == stats.requests == num_requests
    assert stats.evictions == num_evicted
    assert stats.hit_rate == (stats.hits / num_requests if num_requests else 0.0)


def _replay(policy: CachePolicy, lookup: Lookup, admission: Any, step_keys: set) -> None:
    """Hits are touched first, then misses admitted in request order, step keys protected."""
    for (s, h), got in lookup.heads.items():
        for c in got.hit_clusters.tolist():
            policy.touch((s, h, c))
    evicted = []
    for (s, h), got in admission.heads.items():
        for c in got.clusters.tolist():
            evicted += policy.admit((s, h, c), protected=step_keys)
    assert evicted == admission.evicted


def _same(a: Any, b: Any) -> bool:
    """Equality of nested results holding tensors."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "__slots__") and not isinstance(a, tuple):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f))
                                          for f in a.__slots__)
    return bool(a == b)


@pytest.mark.parametrize("name", POLICIES.names())
@SETTINGS
@given(num_slots=st.integers(1, 6), steps=STEPS)
def test_async_equals_sync(name: str, num_slots: int, steps: list[dict]) -> None:
    sync = BlockCache(num_slots, policy=name)
    lookups, admissions = [], []
    for step in steps:
        lookups.append(sync.lookup(step))
        admissions.append(sync.admit(lookups[-1]))
    with BlockCache(num_slots, policy=name) as background:
        futures = []
        for step, lookup in zip(steps, lookups, strict=True):
            assert _same(lookup, background.lookup(step))  # waits for the previous step
            futures.append(background.submit_step(lookup))
        assert background.wait() is futures[-1].result()
        assert background.wait() is None
        assert all(_same(a, f.result()) for a, f in zip(admissions, futures, strict=True))
        assert sync.stats == background.stats
        assert len(sync) == len(background)


class _SlowLRU(LRUPolicy):
    def admit(self, key: Hashable, *, protected: Any = frozenset()) -> list[Hashable]:
        time.sleep(0.02)
        return super().admit(key, protected=protected)


def test_lookup_waits_for_the_submitted_step() -> None:
    with BlockCache(4, policy=_SlowLRU(4)) as cache:
        cache.submit_step(cache.lookup({(0, 0): [1, 2]}))
        assert cache.lookup({(0, 0): [1, 2]}).heads[(0, 0)].hit_slots.tolist() == [0, 1]


def test_shared_executor_is_not_shut_down() -> None:
    with ThreadPoolExecutor(2) as pool:
        layers = [BlockCache(2, executor=pool) for _ in range(3)]
        pending = [c.submit_step(c.lookup({(0, 0): [1, 2, 3]})) for c in layers]
        assert [f.result().heads[(0, 0)].rejected.tolist() for f in pending] == [[3]] * 3
        for cache in layers:
            cache.close()
            cache.close()
        assert pool.submit(int, "7").result() == 7


def test_same_step_clusters_are_protected() -> None:
    cache = BlockCache(2, policy="fifo")
    cache.admit(cache.lookup({(0, 0): [1, 2]}))
    lookup = cache.lookup({(0, 0): [1, 3, 4]})  # FIFO alone would evict 1
    admission = cache.admit(lookup)
    assert admission.evicted == [(0, 0, 2)]
    head = admission.heads[(0, 0)]
    assert (head.clusters.tolist(), head.slots.tolist(), head.rejected.tolist()) == (
        [3], [1], [4])


def test_stale_lookup_is_rejected() -> None:
    cache = BlockCache(4)
    first = cache.lookup({(0, 0): [1]})
    second = cache.lookup({(0, 0): [1]})
    cache.admit(first)
    for call in (cache.admit, cache.submit_step):
        with pytest.raises(InvalidValueError, match="lookup: stale"):
            call(second)
    with pytest.raises(InvalidValueError, match="lookup: expected a Lookup"):
        cache.admit({(0, 0): [1]})  # type: ignore[arg-type]


def test_drop_sequence_frees_its_slots() -> None:
    cache = BlockCache(4)
    cache.admit(cache.lookup({(0, 0): [1, 2], (1, 0): [1, 2]}))
    assert cache.drop_sequence(0) == 2
    assert len(cache) == 2 and (1, 0, 1) in cache and (0, 0, 1) not in cache
    lookup = cache.lookup({(2, 0): [5, 6]})
    head = cache.admit(lookup).heads[(2, 0)]
    assert sorted(head.slots.tolist()) == [0, 1] and cache.stats.evictions == 0


class _FailingPolicy(LRUPolicy):
    def admit(self, key: Hashable, *, protected: Any = frozenset()) -> list[Hashable]:
        raise RuntimeError("policy broke")


def test_worker_errors_reach_the_caller() -> None:
    with BlockCache(2, policy=_FailingPolicy(2)) as cache:
        cache.submit_step(cache.lookup({(0, 0): [1]}))
        with pytest.raises(RuntimeError, match="policy broke"):
            cache.wait()
        assert cache.wait() is None


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_slots": 0}, InvalidValueError, "num_slots"),
    ({"num_slots": True}, InvalidValueError, "num_slots"),
    ({"num_slots": "4"}, InvalidValueError, "num_slots"),
    ({"num_slots": 4, "policy": "lur"}, ConfigError, "did you mean 'lru'"),
    ({"num_slots": 4, "policy": object()}, InvalidValueError, "policy: expected"),
    ({"num_slots": 4, "policy": LRUPolicy(3)}, InvalidValueError, "capacity 4, got capacity 3"),
])
def test_bad_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BlockCache(**kwargs)


def test_non_empty_policy_is_rejected() -> None:
    policy = LRUPolicy(2)
    policy.admit("x")
    with pytest.raises(InvalidValueError, match="holding 1 keys"):
        BlockCache(2, policy=policy)


@pytest.mark.parametrize("requests, error, match", [
    ([1, 2], InvalidValueError, "requests: expected a mapping"),
    ({0: [1]}, InvalidValueError, "keys must be"),
    ({(0, -1): [1]}, InvalidValueError, "keys must be"),
    ({(0, 0, 0): [1]}, InvalidValueError, "keys must be"),
    ({(0, 0): [1, -2]}, InvalidValueError, r"requests\[\(0, 0\)\]: cluster ids must be non-neg"),
    ({(0, 0): [1, 2, 1]}, InvalidValueError, r"requests\[\(0, 0\)\]: .*distinct, 1 repeats"),
    ({(0, 0): [1.0]}, InvalidValueError, r"requests\[\(0, 0\)\]: expected a list"),
    ({(0, 0): [True]}, InvalidValueError, r"requests\[\(0, 0\)\]: cluster ids"),
    ({(0, 0): "12"}, InvalidValueError, r"requests\[\(0, 0\)\]: expected a list"),
    ({(0, 0): torch.tensor([1.0])}, ShapeError, r"requests\[\(0, 0\)\]: expected an integer"),
    ({(0, 0): torch.tensor([True])}, ShapeError, r"requests\[\(0, 0\)\]: expected an integer"),
    ({(0, 0): torch.zeros(2, 2, dtype=torch.int64)}, ShapeError, r"requests\[\(0, 0\)\]: .*shape"),
    ({(0, 0): torch.tensor([3, 3])}, InvalidValueError, "distinct"),
])
def test_bad_requests(requests: Any, error: type[Exception], match: str) -> None:
    cache = BlockCache(4)
    with pytest.raises(error, match=match):
        cache.lookup(requests)
    assert isinstance(cache.lookup({(0, 0): []}), Lookup)
