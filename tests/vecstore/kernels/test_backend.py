"""Backend choice: auto, forced, unavailable, unknown."""

from __future__ import annotations

import pytest
import torch

from vecstore.errors import BackendUnavailableError, InvalidValueError
from vecstore.kernels import backend
from vecstore.kernels.backend import resolve_backend

CPU = torch.device("cpu")


def test_auto_runs_torch_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even with the interpreter on
    assert resolve_backend("auto", CPU) == "torch"
    assert resolve_backend("torch", CPU) == "torch"


def test_unknown_backend_is_an_error():
    with pytest.raises(InvalidValueError, match="backend"):
        resolve_backend("cuda", CPU)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="torch"):
        resolve_backend("triton", CPU)


def test_triton_missing(monkeypatch):
    monkeypatch.setattr(backend, "has_triton", lambda: False)
    with pytest.raises(BackendUnavailableError, match="not installed"):
        resolve_backend("triton", torch.device("cuda"))
    assert resolve_backend("auto", torch.device("cuda")) == "torch"


@pytest.mark.gpu
def test_auto_runs_triton_on_cuda():
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
