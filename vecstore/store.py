"""The Store: a database of sequences (KV caches) with a pluggable index and executor."""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vecstore.checks import check_finite, check_index, check_tensor, parse_dtype
from vecstore.config import StoreConfig, load_config
from vecstore.errors import (
    AlreadyExistsError,
    InvalidValueError,
    NotFoundError,
    SequenceDroppedError,
    ShapeError,
    StoreClosedError,
)
from vecstore.executor.base import EXECUTORS, Executor, Steady
from vecstore.index.base import INDEXES, Index, IndexView
from vecstore.sequence import Sequence
from vecstore.types import QueryResult

__all__ = ["Store"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Store:
    """A collection of sequences sharing one configuration.

    Open with :meth:`Store.open`; ``path=None`` gives an in-memory store.

    Examples
    --------
    >>> import torch
    >>> with Store.open(config={"attention": {"retrieval_budget": 0.05}}) as store:
    ...     seq = store.create("a", num_layers=2, num_kv_heads=1, head_dim=4,
    ...                        dtype=torch.float32)
    ...     store.sequences()
    ['a']
    """

    def __init__(self, config: StoreConfig, path: Path | None = None) -> None:
        self.config = config
        self.path = path
        self._seqs: dict[str, Sequence] = {}
        self._indexes: dict[str, Index] = {}
        self._executor: Executor = EXECUTORS.get(config.executor.kind)(
            device=config.executor.device)
        self._lock = threading.RLock()
        self._closed = False
        self._batch_views: dict[int, tuple[tuple[Any, ...], IndexView | None]] = {}
        for kind in {config.index.kind, "flat"}:
            self._indexes[kind] = INDEXES.get(kind)(config)

    @classmethod
    def open(cls, path: str | Path | None = None,
             config: StoreConfig | Mapping[str, Any] | str | Path | None = None) -> Store:
        """Open a store.

        Parameters
        ----------
        path : str | Path | None
            ``None`` for an in-memory store.
        config : StoreConfig | dict | str | Path | None
            Settings, a mapping of them, or a TOML file path; defaults when ``None``.
        """
        cfg = load_config(config)
        if path is not None:
            raise InvalidValueError("path: on-disk stores are not available yet; use path=None")
        return cls(cfg)

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Release the store; safe to call more than once."""
        with self._lock:
            self._closed = True
            self._batch_views.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_open(self) -> None:
        """Raise :class:`StoreClosedError` if the store was closed."""
        if self._closed:
            raise StoreClosedError("the store is closed")

    # -- catalog -------------------------------------------------------------------------
    def create(self, name: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype | str, device: str | torch.device | None = None,
               fingerprint: str | None = None) -> Sequence:
        """Create an empty sequence.

        Parameters
        ----------
        name : str
            1-128 characters of letters, digits, ``.``, ``_``, ``-``; starts with a
            letter or digit.
        num_layers, num_kv_heads, head_dim : int
            The model's attention shape.
        dtype : torch.dtype | str
            ``float32``, ``float16`` or ``bfloat16``.
        device : str | torch.device, optional
            Where the sequence's tensors live (``executor.device`` by default).
        fingerprint : str, optional
            Identifies the model that produced the KV; integrations check it on reuse.
        """
        self.check_open()
        _check_name(name)
        for arg, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                           ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidValueError(f"{arg}: expected a positive integer, got {value!r}")
        torch_dtype = parse_dtype(dtype)
        dev = torch.device(device if device is not None else self.config.executor.device)
        with self._lock:
            if name in self._seqs:
                raise AlreadyExistsError(f"sequence {name!r} already exists")
            seq = Sequence(self, name, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=torch_dtype, device=dev,
                           fingerprint=fingerprint)
            self._seqs[name] = seq
        return seq

    def sequence(self, name: str) -> Sequence:
        """The sequence called ``name``."""
        self.check_open()
        try:
            return self._seqs[name]
        except (KeyError, TypeError):
            raise NotFoundError(f"no sequence {name!r} in this store "
                                f"(it has {sorted(self._seqs)[:10]})") from None

    def sequences(self) -> list[str]:
        """Names of all sequences, sorted."""
        self.check_open()
        return sorted(self._seqs)

    def drop(self, name: str) -> None:
        """Delete a sequence and everything stored for it."""
        with self._lock:
            seq = self.sequence(name)
            del self._seqs[name]
            seq.is_dropped = True
            self._batch_views.clear()

    # -- data path -----------------------------------------------------------------------
    def index_for(self, layer: int) -> Index:
        """The index serving ``layer`` (``flat`` for layers configured exact)."""
        kind = "flat" if self.config.for_layer(layer).exact else self.config.index.kind
        return self._indexes[kind]

    def append_tokens(self, seq: Sequence, layer: int, keys: torch.Tensor,
                      values: torch.Tensor) -> None:
        """Append validated tokens (called by :meth:`Sequence.append`)."""
        with self._lock:
            seq.layers[layer].append(keys, values)

    def check_query(self, seqs: list[Sequence], layer: int, q: object,
                    scale: float | None) -> tuple[torch.Tensor, float]:
        """Validate a batched query; returns ``q`` grouped ``[B, Hkv, G, L, D]`` (float32)
        and the scale."""
        self.check_open()
        if not isinstance(seqs, (list, tuple)) or not seqs:
            raise InvalidValueError("seqs: expected a non-empty list of Sequence")
        first = seqs[0]
        for s in seqs:
            if not isinstance(s, Sequence) or s._store is not self:
                raise InvalidValueError("seqs: every item must be a Sequence of this store")
            if s.is_dropped:
                raise SequenceDroppedError(f"sequence {s.name!r} was dropped")
            if (s.num_kv_heads, s.head_dim, s.dtype, s.device) != (
                    first.num_kv_heads, first.head_dim, first.dtype, first.device):
                raise InvalidValueError(
                    f"seqs: {s.name!r} and {first.name!r} differ in KV heads, head_dim, "
                    "dtype or device and cannot be queried together")
            check_index(layer, "layer", s.num_layers)
            if s.layers[layer].num_tokens == 0:
                raise InvalidValueError(f"layer {layer} of sequence {s.name!r} holds no tokens")
        H, D = first.num_kv_heads, first.head_dim
        check_tensor(q, "q", shape=(len(seqs), None, None, D), dtype=first.dtype)
        assert isinstance(q, torch.Tensor)
        B, Hq, L, _ = q.shape
        if Hq == 0 or Hq % H or L == 0:
            raise ShapeError(f"q: expected (B, Hq, L, {D}) with Hq a positive multiple of the "
                             f"{H} KV heads and L >= 1, got {tuple(q.shape)}")
        check_finite(q, "q")
        if scale is None:
            scale = 1.0 / math.sqrt(D)
        elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise InvalidValueError(f"scale: expected a positive finite number, got {scale!r}")
        q = q.to(first.device)
        return q.float().reshape(B, H, Hq // H, L, D), float(scale)

    def query(self, seqs: list[Sequence], layer: int, q: torch.Tensor, *,
              scale: float | None = None) -> QueryResult:
        """Attention for a batch of sequences in one call.

        Parameters
        ----------
        seqs : list[Sequence]
            ``B`` sequences of this store with the same KV heads, head_dim, dtype, device.
        layer : int
            Layer index.
        q : torch.Tensor
            ``[B, Hq, L, D]`` queries; row ``b`` attends to every token of ``seqs[b]``.
        scale : float, optional
            Softmax scale, ``1/sqrt(D)`` by default.

        Returns
        -------
        QueryResult
            ``out [B, Hq, L, D]``, ``lse [B, Hq, L]``, stats summed over the batch.
        """
        _, scale = self.check_query(seqs, layer, q, scale)
        q = q.to(seqs[0].device)
        steady = _stack_steady(seqs, layer)
        view = self._batch_view(seqs, layer)
        out, lse, stats = self._executor.run(self.index_for(layer), view, steady, q, scale,
                                             self.config.for_layer(layer))
        return QueryResult(out=out, lse=lse, stats=stats)

    def _batch_view(self, seqs: list[Sequence], layer: int) -> IndexView | None:
        if len(seqs) == 1:
            return seqs[0].layers[layer].view()
        key = tuple((id(s), s.layers[layer].version) for s in seqs)
        cached = self._batch_views.get(layer)
        if cached is not None and cached[0] == key:
            return cached[1]
        views = [s.layers[layer].view() for s in seqs]
        present = [v for v in views if v is not None]
        batch = None
        if present:
            batch = IndexView.stack([v if v is not None else _empty_view(present[0])
                                     for v in views])
        self._batch_views[layer] = (key, batch)
        return batch


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not _NAME.match(name) or name in {".", ".."}:
        raise InvalidValueError(
            f"name: expected 1-128 characters of letters, digits, '.', '_', '-' starting "
            f"with a letter or digit, got {name!r}")


def _stack_steady(seqs: list[Sequence], layer: int) -> Steady:
    parts = [s.layers[layer].steady() for s in seqs]
    S = max(k.shape[1] for k, _ in parts)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(x.shape[0], S - x.shape[1], x.shape[2])], dim=1)

    lengths = torch.tensor([k.shape[1] for k, _ in parts], device=seqs[0].device)
    return Steady(torch.stack([pad(k) for k, _ in parts]),
                  torch.stack([pad(v) for _, v in parts]), lengths)


def _empty_view(like: IndexView) -> IndexView:
    H, D = like.keys.shape[1], like.keys.shape[3]
    dev = like.keys.device
    return IndexView(
        keys=like.keys.new_zeros(1, H, 0, D), values=like.values.new_zeros(1, H, 0, D),
        offsets=torch.zeros(1, H, 1, dtype=torch.long, device=dev),
        sizes=torch.zeros(1, H, 0, dtype=torch.long, device=dev),
        meta={k: v.new_zeros(1, H, 0, *v.shape[3:]) for k, v in like.meta.items()},
        num_units=torch.zeros(1, dtype=torch.long),
    )


