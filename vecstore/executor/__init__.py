"""Executors: compute attention for a query plan (torch reference, kernels, gathers)."""

from vecstore.executor import numba_exec as numba_exec
from vecstore.executor import torch_ref as torch_ref
from vecstore.executor import wave_exec as wave_exec
from vecstore.executor.base import EXECUTORS as EXECUTORS
from vecstore.executor.base import Executor as Executor
from vecstore.executor.base import Steady as Steady

__all__ = ["EXECUTORS", "Executor", "Steady"]
