"""Shared fixtures: in-memory stores, seeded generators, small shapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import settings

from vecstore import Store
from vecstore.cluster import CLUSTERERS
from vecstore.executor import EXECUTORS
from vecstore.index import INDEXES
from vecstore.kvstore import KVSTORES
from vecstore.policies import POLICIES
from vecstore.registry import Registry

settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def mem_store():
    with Store.open() as store:
        yield store


@pytest.fixture
def register() -> Iterator[Callable[[Registry[Any], str, Any], Any]]:
    """``register(REGISTRY, name, plugin)`` registers a plug-in for one test; every plug-in
    registered so is unregistered when the test ends, whatever its outcome."""
    done: list[tuple[Registry[Any], str]] = []

    def add(registry: Registry[Any], name: str, plugin: Any) -> Any:
        registry.register(name)(plugin)
        done.append((registry, name))
        return plugin

    yield add
    for registry, name in reversed(done):
        registry.unregister(name)


@pytest.fixture(autouse=True)
def _registries_left_as_found() -> Iterator[None]:
    """Fail a test that leaves a plug-in registered (or removes one): later tests, and the
    contract suites parametrized over the registries, would see it."""
    registries = (INDEXES, CLUSTERERS, EXECUTORS, KVSTORES, POLICIES)
    before = [r.names() for r in registries]
    yield
    after = [r.names() for r in registries]
    assert after == before, f"registries changed from {before} to {after}: use `register`"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
