"""A sequence: one context's KV cache (layers x KV heads x tokens), the store's table."""

from __future__ import annotations

from typing import Protocol

import torch

from vecstore.checks import (
    check_device,
    check_finite,
    check_index,
    check_positive_int,
    check_tensor,
)
from vecstore.engine.layer_state import LayerState
from vecstore.errors import InvalidValueError, SequenceDroppedError, ShapeError
from vecstore.executor.base import Steady
from vecstore.index.base import IndexView
from vecstore.types import QueryResult, SearchResult

__all__ = ["Sequence", "SequenceOwner"]


class SequenceOwner(Protocol):
    """What a :class:`Sequence` asks of the store that holds it (a
    :class:`vecstore.Store`): the sequence forwards its checked calls there."""

    def check_open(self) -> None:
        """Raise :class:`~vecstore.errors.StoreClosedError` if the store was closed."""

    def append_tokens(self, seq: Sequence, layer: int, keys: torch.Tensor,
                      values: torch.Tensor, *, whole_segments: bool = False) -> None:
        """Store checked ``[Hkv, T, D]`` tokens of ``layer`` of ``seq``."""

    def check_query(self, seqs: list[Sequence], layer: int, q: object,
                    scale: float | None, *, finite: bool = True,
                    grouped: bool = True) -> tuple[torch.Tensor, float]:
        """Check a batched query; returns ``q`` grouped and the scale."""

    def query(self, seqs: list[Sequence], layer: int, q: torch.Tensor, *,
              scale: float | None = None, finite: bool | None = None,
              softcap: float | None = None) -> QueryResult:
        """Attention for a batch of sequences in one call."""


class Sequence:
    """Handle to one stored sequence; create it with :meth:`vecstore.Store.create`.

    Examples
    --------
    >>> from vecstore import Store
    >>> with Store.open() as store:
    ...     seq = store.create("doc", num_layers=1, num_kv_heads=2, head_dim=8,
    ...                        dtype=torch.float32)
    ...     seq.append(0, torch.randn(2, 100, 8), torch.randn(2, 100, 8))
    ...     res = seq.query(0, torch.randn(4, 1, 8))
    >>> res.out.shape, res.stats.tokens_total
    (torch.Size([4, 1, 8]), 100)
    """

    def __init__(self, owner: SequenceOwner, name: str, *, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fingerprint: str | None,
                 layers: list[LayerState]) -> None:
        self._owner = owner
        self.name = name
        self.num_layers = len(layers)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.fingerprint = fingerprint
        self.is_dropped = False
        self.layers = layers

    @property
    def owner(self) -> SequenceOwner:
        """The store holding the sequence."""
        return self._owner

    def __repr__(self) -> str:
        tokens = "dropped" if self.is_dropped else f"tokens={self.layers[0].num_tokens}"
        return (f"Sequence({self.name!r}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, {tokens})")

    @property
    def num_tokens(self) -> int:
        """Tokens stored in layer 0 (every layer holds as many once a step has finished)."""
        if self.is_dropped:
            raise SequenceDroppedError(f"sequence {self.name!r} was dropped")
        return self.layers[0].num_tokens

    @property
    def layer_devices(self) -> list[torch.device]:
        """The device of each layer (all ``device`` unless :meth:`place` moved them)."""
        return [state.device for state in self.layers]

    def place(self, devices: list[str | torch.device]) -> None:
        """Move each layer to its own device, e.g. the GPU its model layer runs on.

        Parameters
        ----------
        devices : list[str | torch.device]
            One device per layer (``cpu``, ``cuda``, ``cuda:N``; or ``meta``, which holds
            shapes only: tests stand it in for a second device). Queries of a layer then
            run on that layer's device and return results there; appends are moved there.

        Examples
        --------
        >>> from vecstore import Store
        >>> with Store.open() as store:
        ...     seq = store.create("m", num_layers=2, num_kv_heads=1, head_dim=4,
        ...                        dtype=torch.float32)
        ...     seq.place(["cpu", "meta"])
        ...     [d.type for d in seq.layer_devices]
        ['cpu', 'meta']
        """
        self._check_alive()
        if not isinstance(devices, (list, tuple)) or len(devices) != self.num_layers:
            raise InvalidValueError(f"devices: expected a list of {self.num_layers} devices "
                                    f"(one per layer), got {devices!r}")
        targets = [check_device(d, f"devices[{i}]", allow_meta=True)
                   for i, d in enumerate(devices)]
        for state, target in zip(self.layers, targets, strict=True):
            state.to(target)

    def tokens(self, layer: int) -> int:
        """Tokens stored in ``layer``."""
        self._check_alive()
        return self.layers[check_index(layer, "layer", self.num_layers)].num_tokens

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, *,
               finite: bool = True, whole_segments: bool = False) -> None:
        """Store new tokens of one layer, indexing them once enough have accumulated.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        keys, values : torch.Tensor
            ``[Hkv, T, D]`` of the sequence's dtype (any device; moved to the sequence's),
            post-RoPE, ``T >= 1``. Prefill in one call, decode one token at a time.
        finite : bool
            Scan ``keys`` and ``values`` for NaN/Inf first (a host sync on a device;
            ``False``: the caller checked them already).
        whole_segments : bool
            A prefill chunk: index only whole ``index.segment_tokens`` segments
            (:meth:`vecstore.engine.layer_state.LayerState.append`).

        Raises
        ------
        ShapeError, InvalidValueError, SequenceDroppedError
            Before anything is stored.
        """
        self._check_alive()
        check_index(layer, "layer", self.num_layers)
        shape = (self.num_kv_heads, None, self.head_dim)
        check_tensor(keys, "keys", shape=shape, dtype=self.dtype)
        check_tensor(values, "values", shape=(self.num_kv_heads, keys.shape[1], self.head_dim),
                     dtype=self.dtype)
        if keys.shape[1] == 0:
            raise ShapeError("keys: expected at least one token, got shape "
                             f"{tuple(keys.shape)}")
        if finite:
            check_finite(keys, "keys")
            check_finite(values, "values")
        dev = self.layers[layer].device
        self._owner.append_tokens(self, layer, keys.to(dev).contiguous(),
                                  values.to(dev).contiguous(), whole_segments=whole_segments)

    def query(self, layer: int, q: torch.Tensor, *, scale: float | None = None,
              softcap: float | None = None) -> QueryResult:
        """Attention of ``q`` over every stored token of ``layer``.

        Parameters
        ----------
        layer : int
            Layer index.
        q : torch.Tensor
            ``[Hq, L, D]`` queries of the sequence's dtype; ``Hq`` a multiple of the KV
            heads (GQA). Queries attend to all stored tokens (no causal mask).
        scale : float, optional
            Softmax scale, ``1/sqrt(D)`` by default.
        softcap : float, optional
            Attention logit soft-cap, none by default (:meth:`Store.query
            <vecstore.Store.query>`).

        Returns
        -------
        QueryResult
            ``out [Hq, L, D]``, ``lse [Hq, L]`` and stats.
        """
        self._check_alive()
        res = self._owner.query([self], layer, _as_batch(q), scale=scale, softcap=softcap)
        return QueryResult(out=res.out[0], lse=res.lse[0], stats=res.stats)

    def search(self, layer: int, q: torch.Tensor, k: int, *,
               scale: float | None = None) -> SearchResult:
        """The raw index probe: the ``k`` best-ranked units of each KV head for ``q``.

        Parameters
        ----------
        q : torch.Tensor
            ``[Hq, L, D]`` queries (ranking sums over the GQA group and the L tokens).
        k : int
            Units to return per KV head, at most the layer's tokens (a unit holds at least
            one); heads with fewer units are padded with id ``-1`` and score ``-inf``.
        """
        self._check_alive()
        check_positive_int(k, "k")
        check_index(layer, "layer", self.num_layers)
        qg, scale = self._owner.check_query([self], layer, _as_batch(q), scale)
        state = self.layers[layer]
        if k > state.num_tokens:
            raise InvalidValueError(f"k: expected at most {state.num_tokens} (the tokens of "
                                    f"layer {layer}; an index unit holds one or more), got {k}")
        view = state.view()
        H = self.num_kv_heads
        ids = torch.full((H, k), -1, dtype=torch.long, device=state.device)
        scores = torch.full((H, k), float("-inf"), device=state.device)
        if view is not None:
            ranked = state.index.rank(view, qg, scale)[0]  # [H, C]
            top = torch.topk(ranked, min(k, ranked.shape[-1]), dim=-1)
            n = top.indices.shape[-1]
            found = torch.isfinite(top.values)
            ids[:, :n] = top.indices.masked_fill(~found, -1)
            scores[:, :n] = top.values
        return SearchResult(ids=ids, scores=scores)

    def kv_blocks(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every token stored in ``layer``, once, as ``[Hkv, n, D]`` key and value blocks.

        The indexed rows (cluster order, where the store keeps them: host memory for
        ``kvstore.kind = "pinned"``), then the steady zone (sinks and tail); empty blocks
        left out. Positions are lost in the indexed rows: the blocks serve attention
        without a mask (a prefill chunk attending to its stored prefix exactly).

        Examples
        --------
        >>> from vecstore import Store
        >>> with Store.open() as store:
        ...     seq = store.create("b", num_layers=1, num_kv_heads=2, head_dim=8,
        ...                        dtype=torch.float32)
        ...     seq.append(0, torch.randn(2, 3000, 8), torch.randn(2, 3000, 8))
        ...     [tuple(k.shape) for k, _ in seq.kv_blocks(0)]  # indexed rows, steady zone
        [(2, 2932, 8), (2, 68, 8)]
        """
        self._check_alive()
        state = self.layers[check_index(layer, "layer", self.num_layers)]
        state.view()  # places segments loaded lazily or rolled back
        rows = state.rows
        indexed = ([(rows.keys, rows.values)] if rows is not None
                   else [(s.keys, s.values) for s in state.segments])
        return [(k, v) for k, v in (*indexed, state.steady()) if k.shape[1]]

    def steady(self, layer: int) -> Steady:
        """The steady zone of ``layer`` as a one-row batch."""
        self._check_alive()
        k, v = self.layers[check_index(layer, "layer", self.num_layers)].steady()
        return Steady(k[None], v[None], torch.tensor([k.shape[1]], device=k.device))

    def view(self, layer: int) -> IndexView | None:
        """The indexed units of ``layer`` (``None`` before the first segment)."""
        self._check_alive()
        return self.layers[check_index(layer, "layer", self.num_layers)].view()

    def release(self, *, forget: bool = True) -> None:
        """Return every layer's placed rows and metadata to the store's budgets (called
        once a drop of the sequence has committed, ``forget``ting its data, or when the
        store closes, keeping it readable)."""
        for state in self.layers:
            state.release(forget=forget)

    def _check_alive(self) -> None:
        if self.is_dropped:
            raise SequenceDroppedError(f"sequence {self.name!r} was dropped")
        self._owner.check_open()


def _as_batch(q: object) -> torch.Tensor:
    """``q [Hq, L, D]`` as a one-row batch, or a ShapeError naming what was given."""
    if not isinstance(q, torch.Tensor):
        raise ShapeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ShapeError(f"q: expected shape (Hq, L, D), got {tuple(q.shape)}")
    return q[None]
