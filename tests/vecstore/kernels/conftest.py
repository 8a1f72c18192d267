"""Fixtures for the decode-kernel tests: which backend runs, on which device.

The Triton path runs compiled on CUDA when a GPU is present, and otherwise in Triton's
interpreter on the CPU. Triton chooses between the two when it is imported (it decorates its
own language functions then), so without a GPU this conftest sets ``TRITON_INTERPRET=1``
before anything here imports triton. If triton was already imported without the interpreter
by the time this directory is collected (another test module or a doctest imported it
first), the Triton-path tests cannot run in this process: they run once, together, in a
subprocess with ``TRITON_INTERPRET=1``, and each reports its own outcome from there.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vecstore.kernels._backend import has_triton

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class Target:
    """Where a kernel test runs: ``backend`` for the call and ``device`` for the tensors."""

    backend: str
    device: torch.device


def _triton_target() -> Target:
    if not has_triton():
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return Target("triton", torch.device("cuda"))
    return Target("triton", torch.device("cpu"))


@pytest.fixture(params=["torch", "triton"])
def target(request: pytest.FixtureRequest) -> Target:
    """Each backend in turn: torch on the CPU, then Triton (GPU or interpreter)."""
    if request.param == "torch":
        return Target("torch", torch.device("cpu"))
    return _triton_target()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per run."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**31)
    return torch.Generator().manual_seed(seed)


def _interpreter_ready() -> bool:
    """Whether Triton kernels can run in this process's interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def _is_delegated(item: pytest.Function) -> bool:
    """Whether ``item`` is a Triton-path test that must run in the interpreter subprocess."""
    callspec = getattr(item, "callspec", None)
    on_triton = callspec is not None and callspec.params.get("target") == "triton"
    return on_triton and has_triton() and not torch.cuda.is_available() and not _interpreter_ready()


@functools.cache
def _subprocess_outcomes(rootdir: str) -> dict[tuple[str, str], ElementTree.Element]:
    """Run this directory's Triton-path tests under the interpreter; outcomes by (module, name)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [
            sys.executable, "-m", "pytest", str(_HERE), "-k", "triton", "-q",
            "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}",
        ]  # fmt: skip
        subprocess.run(command, cwd=rootdir, env=env, capture_output=True, timeout=900, check=False)
        if not report.exists():
            return {}
        cases = ElementTree.parse(report).getroot().iter("testcase")
        return {(c.get("classname", "").rsplit(".", 1)[-1], c.get("name", "")): c for c in cases}


def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Report a delegated test's outcome from the interpreter subprocess instead of running it."""
    if not _is_delegated(pyfuncitem):
        return None
    outcomes = _subprocess_outcomes(str(pyfuncitem.config.rootpath))
    case = outcomes.get((pyfuncitem.path.stem, pyfuncitem.name))
    if case is None:
        pytest.fail("no outcome from the TRITON_INTERPRET=1 subprocess run", pytrace=False)
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            detail = found.text or found.get("message", "")
            pytest.fail(f"failed under TRITON_INTERPRET=1 (subprocess):\n{detail}", pytrace=False)
    skipped = case.find("skipped")
    if skipped is not None:
        pytest.skip(skipped.get("message", "skipped in the interpreter subprocess"))
    return True
