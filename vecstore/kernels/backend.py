"""Backend choice for the decode kernels, and how a kernel is launched.

An executor takes ``backend="auto" | "triton" | "torch"`` (:func:`resolve_backend`). ``"auto"``
picks Triton when the inputs live on a CUDA device and Triton is importable, the torch
reference (:mod:`vecstore.kernels.reference`) otherwise. ``"triton"`` on CPU tensors runs only
under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests exercise the
kernels without a GPU.

Kernels are wrapped in :class:`LazyKernel`, which applies ``triton.jit`` at the first launch
rather than at import, so importing a kernel module does no Triton work. Note that
``TRITON_INTERPRET=1`` must be set before ``triton`` itself is imported: Triton decorates its
own language functions (``tl.sum``, ``tl.zeros``, ...) then, and interpreted kernels cannot
call compiled ones.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from vecstore.errors import BackendUnavailableError, InvalidValueError, ShapeError

__all__ = [
    "Backend",
    "BACKENDS",
    "LazyKernel",
    "has_triton",
    "is_interpreted",
    "needs_f32_dot",
    "num_sms",
    "resolve_backend",
    "row_stride",
]

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")

_TRUE = ("1", "true", "on", "yes", "y")


def has_triton() -> bool:
    """Return whether the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def is_interpreted() -> bool:
    """Return whether Triton kernels launched now run in the interpreter (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch"]:
    """Return the backend that runs a kernel on tensors of ``device``.

    Parameters
    ----------
    backend : {"auto", "triton", "torch"}
        What the caller asked for.
    device : torch.device
        Device of the kernel's inputs.

    Raises
    ------
    InvalidValueError
        If ``backend`` is not one of :data:`BACKENDS`.
    BackendUnavailableError
        If ``"triton"`` is asked for but Triton is missing, or the tensors are on the CPU and
        the interpreter is off.
    """
    if backend not in BACKENDS:
        raise InvalidValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    triton_ok = has_triton() and (device.type == "cuda" or is_interpreted())
    if backend == "auto":
        return "triton" if triton_ok and device.type == "cuda" else "torch"
    if not has_triton():
        raise BackendUnavailableError(
            "backend: 'triton' asked for but triton is not installed; available: 'torch' "
            "(install vecstore[gpu] for triton)"
        )
    if not triton_ok:
        raise BackendUnavailableError(
            f"backend: 'triton' needs CUDA tensors or TRITON_INTERPRET=1, got {device.type} "
            "tensors; available: 'torch'"
        )
    return "triton"


class LazyKernel:
    """A Triton kernel that is jitted at its first launch (once per interpreter setting).

    Parameters
    ----------
    fn : callable
        The undecorated kernel function, written as for ``@triton.jit``. It may call plain
        ``@triton.jit`` device functions (:mod:`vecstore.kernels._device`), not other
        :class:`LazyKernel` kernels, since those would be resolved through this wrapper.
    do_not_specialize : sequence of str
        Arguments Triton should not specialize on (an integer's being 1 or a multiple of 16,
        a pointer's 16-byte alignment): each new specialization compiles the kernel again,
        so arguments that change as a layer grows compile it again mid-decode.

    Examples
    --------
    >>> def _noop(x_ptr):
    ...     pass
    >>> LazyKernel(_noop).__name__
    '_noop'
    """

    def __init__(self, fn: Callable[..., None], do_not_specialize: Sequence[str] = ()) -> None:
        self._fn = fn
        self._plain = tuple(do_not_specialize)
        self._jitted: dict[bool, Any] = {}
        self.__name__ = fn.__name__

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        mode = is_interpreted()
        kernel = self._jitted.get(mode)
        if kernel is None:
            import triton

            kernel = self._jitted[mode] = triton.jit(
                self._fn, do_not_specialize=self._plain,
                do_not_specialize_on_alignment=self._plain)
        return kernel[grid]  # type: ignore[no-any-return]


def needs_f32_dot(dtype: torch.dtype) -> bool:
    """Return whether ``tl.dot`` operands of ``dtype`` must be upcast to float32 first.

    Triton's interpreter multiplies bfloat16 operands as their raw 16-bit integers, so under
    ``TRITON_INTERPRET=1`` bfloat16 operands go through the dot as float32 (exact, since
    bfloat16 converts to float32 without rounding). Compiled kernels keep bfloat16 operands.
    """
    return dtype == torch.bfloat16 and is_interpreted()


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 2 elsewhere (the interpreter: a few
    programs, enough to exercise grids that loop)."""
    if device.type != "cuda":
        return 2
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def row_stride(*rows: torch.Tensor) -> int:
    """Rows of ``D`` from one ``[rows, N, D]`` KV row to the next, the same for every tensor
    of ``rows``: each row's ``[N, D]`` block must be contiguous, and blocks may sit further
    apart than ``N`` rows (a tier grows a layer's rows in place within a reserve).

    Examples
    --------
    >>> reserve = torch.zeros(4, 10, 8)
    >>> row_stride(reserve[:, :6], reserve[:, :6])
    10
    """
    x = rows[0]
    dim = x.shape[-1]
    for r in rows:
        if r.stride()[1:] != (dim, 1) or r.stride(0) != x.stride(0) or r.stride(0) % dim:
            raise ShapeError(f"KV rows must be [rows, N, D] with contiguous [N, D] blocks "
                             f"a common whole number of rows apart, got strides {r.stride()}")
    return x.stride(0) // dim
