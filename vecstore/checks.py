"""Boundary checks: every public entry point validates its inputs here, once."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from vecstore.errors import BackendUnavailableError, InvalidValueError, ShapeError

__all__ = ["check_tensor", "check_finite", "check_all_finite", "FiniteCheck", "check_index",
           "check_name", "check_positive_int", "check_softcap", "check_device", "parse_device",
           "parse_dtype", "SUPPORTED_DTYPES", "MAX_DIMENSION"]

SUPPORTED_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the torch dtype for ``dtype`` (a dtype or its name); only float types."""
    if isinstance(dtype, torch.dtype):
        if dtype in SUPPORTED_DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in SUPPORTED_DTYPES:
            return SUPPORTED_DTYPES[name]
    raise InvalidValueError(
        f"dtype: expected one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}"
    )


def _fmt(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def check_tensor(
    x: object,
    name: str,
    *,
    shape: Sequence[int | None],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Check that ``x`` is a tensor of ``shape`` (``None`` = any size) and ``dtype``.

    Raises
    ------
    ShapeError
        Naming ``name``, the expected and the received shape and dtype.
    """
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    bad_shape = x.dim() != len(shape) or any(
        s is not None and s != n for s, n in zip(shape, x.shape, strict=True))
    if bad_shape or (dtype is not None and x.dtype != dtype):
        # the message is built only on failure: this runs on every append and query
        want = _fmt(shape) + (f" {str(dtype).removeprefix('torch.')}" if dtype else "")
        got = _fmt(tuple(x.shape)) + f" {str(x.dtype).removeprefix('torch.')}"
        what = "shape" if bad_shape else "dtype"
        raise ShapeError(f"{name}: expected {what} {want}, got {got}")
    return x


def _check_has_data(x: torch.Tensor, name: str) -> None:
    if x.is_meta:
        raise ShapeError(f"{name}: is on the meta device, which holds no values; pass a "
                         "tensor on the CPU or a CUDA device")


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise :class:`InvalidValueError` if ``x`` holds NaN or Inf (a host sync on a device),
    :class:`ShapeError` if it holds no values at all (the ``meta`` device)."""
    _check_has_data(x, name)
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise InvalidValueError(f"{name}: contains {bad} NaN/Inf value(s)")


def check_all_finite(**tensors: torch.Tensor) -> None:
    """:func:`check_finite` of several tensors with one host sync for all of them (they
    must share a device); raises naming the first, in argument order, that is not."""
    FiniteCheck(**tensors).wait()


class FiniteCheck:
    """:func:`check_all_finite` started now and read later: the scan is queued on the
    tensors' device at construction, and :meth:`wait` waits for that scan alone (on CUDA,
    an event after it, not the device's later work) and raises as :func:`check_all_finite`
    does. Work queued between the two (an attention) keeps the device busy while the host
    waits. A tensor on the ``meta`` device raises :class:`ShapeError` at once.

    Examples
    --------
    >>> check = FiniteCheck(keys=torch.ones(2), values=torch.tensor([1.0, float("nan")]))
    >>> check.wait()
    Traceback (most recent call last):
    ...
    vecstore.errors.InvalidValueError: values: contains 1 NaN/Inf value(s)
    """

    def __init__(self, **tensors: torch.Tensor) -> None:
        self._items = list(tensors.items())
        for name, t in self._items:
            _check_has_data(t, name)
        flags = torch.stack([torch.isfinite(t).all() for _, t in self._items])
        self._event: torch.cuda.Event | None = None
        if flags.is_cuda:
            # copied into page-locked memory behind the scan: the host reads it after the
            # event, without waiting for the rest of the stream
            self._flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._flags.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flags.device))
        else:
            self._flags = flags

    def wait(self) -> None:
        """Raise :class:`InvalidValueError` naming the first tensor, in argument order,
        that holds a NaN or Inf; return if none does."""
        if self._event is not None:
            self._event.synchronize()
        for (name, t), good in zip(self._items, self._flags.tolist(), strict=True):
            if not good:
                check_finite(t, name)


def check_index(value: object, name: str, upper: int) -> int:
    """Check ``0 <= value < upper`` for an integer index."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidValueError(f"{name}: expected an integer, got {value!r}")
    if not 0 <= value < upper:
        raise InvalidValueError(f"{name}: expected 0 <= {name} < {upper}, got {value}")
    return value


MAX_DIMENSION = 4096
"""Largest ``num_layers``, ``num_kv_heads`` and ``head_dim`` a sequence may have."""


def check_positive_int(value: object, name: str, upper: int | None = None) -> int:
    """Return ``value`` if it is an int ``>= 1`` (not a bool) and at most ``upper``, else
    raise :class:`InvalidValueError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValueError(f"{name}: expected a positive integer, got {value!r}")
    if upper is not None and value > upper:
        raise InvalidValueError(f"{name}: expected at most {upper}, got {value}")
    return value


def check_softcap(value: object, name: str = "softcap") -> float | None:
    """Return an attention logit soft-cap as a float (``None``: no cap), or raise
    :class:`InvalidValueError` naming ``name`` unless it is ``None`` or a finite positive
    number (not a bool).

    Examples
    --------
    >>> check_softcap(None), check_softcap(50)
    (None, 50.0)
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise InvalidValueError(f"{name}: expected None or a positive finite number, "
                                f"got {value!r}")
    return float(value)


_DEVICE = "'cpu', 'cuda' or 'cuda:N'"


def parse_device(value: object, name: str, *, allow_meta: bool = False) -> torch.device:
    """``value`` (a ``str`` or ``torch.device``) as a device vecstore runs on: ``cpu`` or
    ``cuda[:N]`` (and ``meta`` with ``allow_meta``); checks the form only.

    Examples
    --------
    >>> parse_device("cuda:1", "device")
    device(type='cuda', index=1)
    >>> parse_device("tpu", "device")
    Traceback (most recent call last):
    ...
    vecstore.errors.InvalidValueError: device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'
    """
    kinds = ("cpu", "cuda", "meta") if allow_meta else ("cpu", "cuda")
    dev = None
    if isinstance(value, torch.device):
        dev = value
    elif isinstance(value, str):
        try:
            dev = torch.device(value)
        except (RuntimeError, ValueError):
            dev = None
    if dev is None or dev.type not in kinds:
        raise InvalidValueError(f"{name}: expected {_DEVICE}, got {value!r}")
    return dev


def check_device(value: object, name: str, *, allow_meta: bool = False) -> torch.device:
    """:func:`parse_device`, then check that the device exists here.

    Raises
    ------
    InvalidValueError
        Not a device of a kind vecstore runs on.
    BackendUnavailableError
        A CUDA device this torch cannot see.
    """
    dev = parse_device(value, name, allow_meta=allow_meta)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"{name}: {value!r} needs CUDA, but this torch sees no CUDA device "
                "(torch.cuda.is_available() is False); use 'cpu'")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise BackendUnavailableError(f"{name}: {value!r} does not exist; this machine "
                                          f"has {count} CUDA device(s)")
    return dev


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: object) -> None:
    """Check a sequence name: 1-128 letters, digits, ``.``, ``_``, ``-``, starting with a
    letter or digit (``.`` and ``..`` refused).

    Raises
    ------
    InvalidValueError
        Naming the rule and the value.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in {".", ".."}:
        raise InvalidValueError(
            f"name: expected 1-128 characters of letters, digits, '.', '_', '-' starting "
            f"with a letter or digit, got {name!r}")


def check_new_sequence(name: object, shape: dict[str, object], fingerprint: object,
                       dtype: torch.dtype | str) -> torch.dtype:
    """Check the arguments of a new sequence (its name, each positive int of ``shape``,
    the fingerprint, str or ``None``) and return its dtype parsed.

    Raises
    ------
    InvalidValueError
        Naming the first bad argument and its value.
    """
    check_name(name)
    for arg, value in shape.items():
        check_positive_int(value, arg, MAX_DIMENSION)
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise InvalidValueError(f"fingerprint: expected a str or None, got {fingerprint!r}")
    return parse_dtype(dtype)
