"""Compile the Triton kernels a CPU test launched for a GPU target, without a GPU.

:func:`recorded_launches` records, while the kernels run in Triton's interpreter, every
distinct launch of a :class:`~vecstore.kernels.backend.LazyKernel`: the kernel, its argument
types and its compile-time constants. :func:`compile_failures` hands them to a subprocess
without the interpreter (Triton decides at import whether it compiles), which compiles each
to a cubin for the target with Triton's own ptxas, and returns what failed. Run as
``python -m tests.kernel_compile SPECS.pkl ARCH`` that subprocess is this module.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_POINTER = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
            torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages")


@dataclass(frozen=True)
class Launch:
    """One distinct launch: ``module.name`` with Triton's ``signature`` (argument name ->
    type, ``"constexpr"`` for constants), the ``constants`` and compile ``options``."""

    module: str
    name: str
    signature: dict[str, str] = field(hash=False)
    constants: dict[str, Any] = field(hash=False)
    options: dict[str, int] = field(hash=False)

    def key(self) -> tuple[str, str, str, str]:
        return (self.module, self.name, repr(sorted(self.constants.items())),
                repr(sorted(self.options.items())))


def _arg_type(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    return None


def _describe(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Launch:
    signature, constants, options = {}, {}, {}
    for name, value in zip(inspect.signature(fn).parameters, args, strict=False):
        kind = _arg_type(value)
        signature[name] = kind or "constexpr"
        if kind is None:
            constants[name] = value
    for name, value in kwargs.items():
        if name in _OPTIONS:
            options[name] = value
        else:
            signature[name] = "constexpr"
            constants[name] = value
    return Launch(fn.__module__, fn.__name__, signature, constants, options)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Record every distinct LazyKernel launch made in the block (the kernels still run)."""
    from vecstore.kernels.backend import LazyKernel

    launches: dict[tuple[str, str, str, str], Launch] = {}
    original = LazyKernel.__getitem__

    def getitem(self: LazyKernel, grid: tuple[int, ...]) -> Any:
        launch = original(self, grid)

        def run(*args: Any, **kwargs: Any) -> Any:
            found = _describe(self._fn, args, kwargs)
            launches.setdefault(found.key(), found)
            return launch(*args, **kwargs)

        return run

    out: list[Launch] = []
    LazyKernel.__getitem__ = getitem  # type: ignore[method-assign]
    try:
        yield out
    finally:
        LazyKernel.__getitem__ = original  # type: ignore[method-assign]
        out.extend(launches.values())


def compile_failures(launches: list[Launch], workdir: Path, arch: int = 90) -> dict[str, str]:
    """Compile every launch for ``sm_{arch}`` in a subprocess without the interpreter;
    ``{kernel and constants: error}`` for those that fail."""
    specs = workdir / "launches.pkl"
    specs.write_bytes(pickle.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "tests.kernel_compile", str(specs), str(arch)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1200,
                          check=False)
    if done.returncode != 0:
        return {"subprocess": done.stderr[-4000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile_all(path: str, arch: int) -> dict[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget

    failures = {}
    for launch in pickle.loads(Path(path).read_bytes()):
        fn = getattr(importlib.import_module(launch.module), launch.name)
        src = triton.compiler.ASTSource(fn=triton.jit(fn), signature=launch.signature,
                                        constexprs=launch.constants)
        try:
            triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)
        except Exception as exc:  # every compiler error is reported, whatever its type
            failures[f"{launch.name} {launch.constants} {launch.options}"] = str(exc)[-2000:]
    return failures


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1], int(sys.argv[2]))))
