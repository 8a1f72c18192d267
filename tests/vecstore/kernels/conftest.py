"""Fixtures for the decode-kernel tests, which run the kernels in Triton's interpreter on CPU
tensors (``@interpreted``, :mod:`tests.interpreter`) and compiled on a CUDA device
(``-m gpu``).

Triton chooses between compiling and interpreting when it is imported, so this conftest asks
for the interpreter before any test module here imports a kernel module.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import request_interpreter

request_interpreter()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per run."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**31)
    return torch.Generator().manual_seed(seed)
