"""Run Triton-kernel tests in Triton's interpreter on CPU tensors, whatever the import order.

Triton decides between compiling and interpreting when it is imported: it decorates its own
language functions then. A test module sets ``TRITON_INTERPRET=1`` at import when nothing has
imported triton yet (:func:`request_interpreter`); if something already imported it compiled
(in a full run, transformers' imports pull in triton through ``torch._dynamo``), a test
decorated with :func:`interpreted` is not run in this process: the module's interpreted tests
run once, together, in a subprocess with ``TRITON_INTERPRET=1``, and each test reports its
own outcome from there.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

_CHILD = "VECSTORE_INTERPRETER_CHILD"


def request_interpreter() -> None:
    """Ask for the interpreter if there is no GPU and triton is not imported yet."""
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreter_ready() -> bool:
    """Whether Triton kernels launched in this process run in the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


@functools.cache
def _outcomes(path: str) -> dict[str, ElementTree.Element]:
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD: "1"}
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        subprocess.run([sys.executable, "-m", "pytest", path, "-m", "not gpu", "-q",
                        "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}"],
                       cwd=root, env=env, capture_output=True, timeout=900, check=False)
        if not report.exists():
            return {}
        return {c.get("name", ""): c for c in ElementTree.parse(report).getroot().iter("testcase")}


def interpreted(test: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a test that launches Triton kernels on CPU tensors."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available():
            pytest.skip("a GPU is present: the GPU tests run the compiled kernels")
        if interpreter_ready():
            previous = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"  # kernels choose their mode at launch
            try:
                return test(*args, **kwargs)
            finally:
                if previous is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = previous
        if os.environ.get(_CHILD):
            pytest.fail("triton was imported compiled even in the interpreter subprocess")
        case = _outcomes(test.__code__.co_filename).get(os.environ["PYTEST_CURRENT_TEST"]
                                                        .split("::")[-1].split(" ")[0])
        if case is None:
            pytest.fail("no outcome from the TRITON_INTERPRET=1 subprocess", pytrace=False)
        for tag in ("failure", "error"):
            found = case.find(tag)
            if found is not None:
                pytest.fail(f"failed under TRITON_INTERPRET=1 (subprocess):\n"
                            f"{found.text or found.get('message', '')}", pytrace=False)
        if case.find("skipped") is not None:
            pytest.skip("skipped in the interpreter subprocess")
        return None

    return wrapper
