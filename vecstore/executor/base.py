"""The Executor interface: computes tripartite attention for a batch of sequences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from vecstore.config import LayerConfig, StoreConfig
from vecstore.index.base import Index, IndexView
from vecstore.kernels.backend import has_triton
from vecstore.kvstore.base import MemoryAccount
from vecstore.registry import Registry
from vecstore.types import QueryStats

__all__ = ["Steady", "Executor", "EXECUTORS", "build_executor", "resolve_kind"]


@dataclass(frozen=True, slots=True)
class Steady:
    """The exact steady zone of ``B`` sequences (sinks and not-yet-indexed tokens).

    Attributes
    ----------
    keys, values : torch.Tensor
        ``[B, Hkv, S, D]``, padded at the end.
    lengths : torch.Tensor
        ``[B]`` int64 valid rows per sequence.
    persistent : bool
        Whether ``keys``, ``values`` and ``lengths`` stay where they are from step to step
        and are updated in place (a :class:`~vecstore.engine.tail.TailBuffer`): a captured step may
        read them there rather than from copies.
    """

    keys: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    persistent: bool = False


@runtime_checkable
class Executor(Protocol):
    """Runs one layer's query: steady zone + retrieved units + estimated units, merged."""

    def run(
        self, index: Index, view: IndexView | None, steady: Steady, q: torch.Tensor,
        scale: float, layer: LayerConfig, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, QueryStats]:
        """Attention of ``q`` over every stored token of each sequence.

        Parameters
        ----------
        index : Index
            The layer's index (ranks units).
        view : IndexView | None
            Indexed units of the ``B`` sequences, ``None`` when nothing is indexed yet.
        steady : Steady
            The steady zone.
        q : torch.Tensor
            ``[B, Hq, L, D]`` queries.
        scale : float
            Softmax scale.
        layer : LayerConfig
            The layer's budgets.
        softcap : float | None
            Attention logit soft-cap (Gemma 2): every zone's scores ``x`` become
            ``softcap * tanh(x / softcap)`` before the softmax (the steady and retrieved
            keys' scores, and the estimated clusters' centroid scores); ``None``: no cap.
            The clusters are ranked by the uncapped scores: the cap is monotonic, so a
            query head's ranking is the same, and the GQA-summed one nearly so.

        Returns
        -------
        tuple
            ``out [B, Hq, L, D]`` (``q.dtype``), ``lse [B, Hq, L]`` float32, and stats.
        """
        ...


EXECUTORS: Registry[type] = Registry("executor")


def resolve_kind(kind: str, device: str) -> str:
    """The executor kind that ``kind`` names on ``device``: ``"auto"`` is ``"wave"`` on a
    CUDA device where Triton is installed, ``"numba"`` (the fused CPU step) on the CPU and
    ``"torch"`` elsewhere; any other kind is kept as given.

    Examples
    --------
    >>> resolve_kind("auto", "cpu"), resolve_kind("torch", "cpu")
    ('numba', 'torch')
    """
    if kind != "auto":
        return kind
    if device.startswith("cuda") and has_triton():
        return "wave"
    return "numba" if device == "cpu" else "torch"


def build_executor(config: StoreConfig,
                   accounts: Callable[[torch.device], MemoryAccount] | None = None) -> Executor:
    """The executor a store of ``config`` queries with: ``executor.kind`` (resolved by
    :func:`resolve_kind`) on ``executor.device``. A registered class with a
    ``from_config(config, accounts)`` classmethod builds itself from the whole configuration
    (the wave executor takes its block cache's policy and size from ``cache``, and charges
    the wave buffers it builds to ``accounts(device)``: the store's
    ``kvstore.gpu_budget_gb`` account of that device).

    Raises
    ------
    ConfigError
        ``executor.kind`` names nothing registered (a store checks every plug-in a
        configuration names first: :func:`vecstore.plugins.check_plugins`).

    Examples
    --------
    >>> ex = build_executor(StoreConfig.from_dict({"executor": {"kind": "torch"}}))
    >>> type(ex).__name__, ex.device
    ('TorchExecutor', 'cpu')
    """
    cls = EXECUTORS.get(resolve_kind(config.executor.kind, config.executor.device))
    from_config = getattr(cls, "from_config", None)
    if from_config is not None:
        return from_config(config, accounts)
    return cls(device=config.executor.device)
