"""Shared fixtures: in-memory stores, seeded generators, small shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from vecstore import Store

settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def mem_store():
    with Store.open() as store:
        yield store


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
