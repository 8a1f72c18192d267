"""Boundary checks shared by the decode kernels (on top of :func:`vecstore.checks.check_tensor`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vecstore.checks import check_tensor
from vecstore.errors import InvalidValueError, ShapeError

__all__ = [
    "check_scale",
    "float_input",
    "group_size",
    "int_input",
    "output_pair",
    "same_device",
    "state_outputs",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def float_input(
    x: object, name: str, shape: Sequence[int | None], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Check a float16/bfloat16/float32 tensor of ``shape`` (and ``dtype``); make it contiguous."""
    t = check_tensor(x, name, shape=shape, dtype=dtype)
    if t.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{name}: expected float32, float16 or bfloat16, got {t.dtype}")
    return t.contiguous()


def int_input(x: object, name: str, shape: Sequence[int | None]) -> torch.Tensor:
    """Check an integer tensor of ``shape``; make it contiguous."""
    t = check_tensor(x, name, shape=shape)
    if t.dtype not in INT_DTYPES:
        raise ShapeError(f"{name}: expected an integer dtype, got {t.dtype}")
    return t.contiguous()


def same_device(**tensors: torch.Tensor) -> torch.device:
    """Return the device shared by all ``tensors``; raise ShapeError naming any that differ."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        got = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ShapeError(f"expected all inputs on one device, got {got}")
    return first


def group_size(num_q_heads: int, num_kv_heads: int) -> int:
    """Return ``G = Hq // Hkv``; raise ShapeError unless Hkv divides Hq."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ShapeError(
            f"q: expected a number of query heads divisible by the {num_kv_heads} KV heads, "
            f"got {num_q_heads}"
        )
    return num_q_heads // num_kv_heads


def check_scale(scale: object) -> float:
    """Return ``scale`` as a float; raise InvalidValueError unless it is finite and positive."""
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise InvalidValueError(f"scale: expected a positive float, got {scale!r}")
    value = float(scale)
    if not (value > 0 and value != float("inf")):
        raise InvalidValueError(f"scale: expected a finite positive float, got {scale!r}")
    return value


def output_pair(
    out: object,
    names: tuple[str, str],
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
    dtypes: tuple[torch.dtype, torch.dtype],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the two output tensors: the caller's ``out`` pair, checked, or new empty ones.

    Caller-provided outputs (for CUDA graphs, or to reuse buffers) must be contiguous, on
    ``device``, and of the given shapes and dtypes; they are overwritten entirely.
    """
    if out is None:
        return (
            torch.empty(shapes[0], dtype=dtypes[0], device=device),
            torch.empty(shapes[1], dtype=dtypes[1], device=device),
        )
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ShapeError(f"out: expected a pair of tensors {names}, got {type(out).__name__}")
    checked = []
    for x, name, shape, dtype in zip(out, names, shapes, dtypes, strict=True):
        t = check_tensor(x, f"out.{name}", shape=shape, dtype=dtype)
        if t.device != device or not t.is_contiguous():
            raise ShapeError(
                f"out.{name}: expected a contiguous tensor on {device}, got "
                f"{'a contiguous' if t.is_contiguous() else 'a strided'} tensor on {t.device}"
            )
        checked.append(t)
    return checked[0], checked[1]


def state_outputs(
    out: object, batch: int, num_q_heads: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return an attention state's outputs: float32 ``out [B, Hq, D]`` and ``lse [B, Hq]``.

    The caller's ``out`` pair, checked as in :func:`output_pair`, or new tensors.
    """
    return output_pair(
        out,
        ("out", "lse"),
        ((batch, num_q_heads, dim), (batch, num_q_heads)),
        (torch.float32, torch.float32),
        device,
    )
