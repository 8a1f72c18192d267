"""The framework-neutral entry point: (q, k, v, layer, validity) in, attention output out.

A model binding (``integrations.hf`` for transformers) calls :class:`StoreAttention`
from each attention layer with the step's post-RoPE queries, keys and values. Steps with
several tokens go through :func:`attention.prefill.prefill`, single-token steps over a
non-empty store through :func:`attention.decode.decode`; either way the valid tokens end
up in the store, one :class:`vecstore.Sequence` per batch row. Unless
``attention.prefill_mirror_gb`` is 0, the prompt's chunks keep offloaded rows' stored
prefixes on the device (:class:`attention.prefix_mirror.PrefixMirror`) until the first
decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attention.decode import decode
from attention.gqa import group_size
from attention.prefill import prefill
from attention.prefix_mirror import PrefixMirror
from vecstore import Sequence, Store
from vecstore.checks import check_softcap, check_tensor
from vecstore.engine.decoder import BatchDecoder
from vecstore.errors import InvalidValueError, ShapeError
from vecstore.types import QueryStats

__all__ = ["StoreAttention", "DecodeStats"]

_MAX_PENDING = 4096  # decode stats kept unread before they are folded (one sync each time)


@dataclass(frozen=True, slots=True)
class DecodeStats:
    """What the decode queries read, summed over layers, steps and batch rows.

    Attributes
    ----------
    queries : int
        Layer queries answered by the store (decode steps x layers).
    tokens_total : int
        Tokens stored when each query ran, summed.
    tokens_exact : int
        Tokens attended exactly (steady zone + retrieved units), summed.
    estimated_mass : float
        Mean share of softmax mass carried by the estimation zone.
    """

    queries: int = 0
    tokens_total: int = 0
    tokens_exact: int = 0
    estimated_mass: float = 0.0

    @property
    def exact_fraction(self) -> float:
        """Share of the context read exactly per query (1.0 before any query)."""
        return self.tokens_exact / self.tokens_total if self.tokens_total else 1.0

    def add(self, stats: QueryStats) -> DecodeStats:
        """These stats with one more query's folded in."""
        return self.add_sums(1, stats.tokens_total, stats.tokens_exact, stats.estimated_mass)

    def add_sums(self, queries: int, tokens_total: int, tokens_exact: int,
                 estimated_mass: float) -> DecodeStats:
        """These stats with ``queries`` more folded in, given their sums (of the estimated
        mass too)."""
        n = self.queries + queries
        if not n:
            return self
        return DecodeStats(
            queries=n, tokens_total=self.tokens_total + tokens_total,
            tokens_exact=self.tokens_exact + tokens_exact,
            estimated_mass=(self.estimated_mass * self.queries + estimated_mass) / n,
        )


class StoreAttention:
    """Attention for one batch of sequences of a store, layer by layer.

    Parameters
    ----------
    store : Store
        The store that holds ``seqs``.
    seqs : list[Sequence]
        One sequence per batch row, all with the same shape.

    Attributes
    ----------
    mirror : PrefixMirror | None
        The rows' stored prefixes the prefill keeps on the device
        (``attention.prefill_mirror_gb``; ``None`` when it is 0); emptied by the first decode
        step and by :meth:`release`.

    Examples
    --------
    >>> from vecstore import Store
    >>> store = Store.open()
    >>> seqs = [store.create(n, num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    ...         for n in ("a", "b")]
    >>> attn = StoreAttention(store, seqs)
    >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    >>> valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    >>> attn(0, q, k, v, valid=valid).shape               # prefill: exact, then stored
    torch.Size([2, 4, 5, 8])
    >>> [s.num_tokens for s in seqs]                       # padding is never stored
    [5, 3]
    >>> out = attn(0, q[:, :, :1], k[:, :, :1], v[:, :, :1])  # decode: through the store
    >>> attn.decode_stats.queries
    1
    """

    def __init__(self, store: Store, seqs: list[Sequence]) -> None:
        if not seqs:
            raise InvalidValueError("seqs: expected at least one sequence")
        self.store = store
        self.seqs = list(seqs)
        self._stats = DecodeStats()
        self._pending: list[QueryStats] = []  # not folded into _stats yet (maybe deferred)
        self._prefilled: set[int] = set()  # layers whose last call was a prefill
        self._decoder: BatchDecoder | None = None  # whose stats are not folded yet
        gb = store.config.attention.prefill_mirror_gb
        mirror_bytes = None if gb is None else int(gb * 2**30)  # None: the device's bound
        self.mirror = PrefixMirror(mirror_bytes) if mirror_bytes != 0 else None

    @property
    def decode_stats(self) -> DecodeStats:
        """What the decode queries read so far, summed (reads back any stats the device
        still holds: one host sync, only when asked)."""
        self._fold()
        return self._stats

    def _fold(self) -> None:
        QueryStats.materialize(self._pending)
        for stats in self._pending:
            self._stats = self._stats.add(stats)
        self._pending.clear()
        if self._decoder is not None:
            queries, sums = self._decoder.take_stats()
            total, exact, _, _, mass = sums.tolist()
            self._stats = self._stats.add_sums(queries, round(total), round(exact), mass)

    def release(self) -> None:
        """Free the device memory the prompt's prefill holds (:attr:`mirror`), once the
        prompt is through (a later prefill builds the mirror again from the rows' tiers)."""
        if self.mirror is not None:
            self.mirror.clear()

    def decoder(self, num_q_heads: int) -> BatchDecoder | None:
        """Fixed-shape decode steps of the batch for a CUDA graph of a model's whole decode
        forward (:meth:`vecstore.engine.store.Store.decoder`), or ``None`` when the batch does not
        qualify now. Call it after an ordinary decode step; its steps count in
        :attr:`decode_stats`."""
        if any(layer in self._prefilled for layer in range(self.seqs[0].num_layers)):
            return None  # the first decode step seals the prefill
        decoder = self.store.decoder(self.seqs, num_q_heads)
        if decoder is not None:
            self._fold()  # the previous decoder's stats
            self._decoder = decoder
        return decoder

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 valid: torch.Tensor | None = None, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """Attention of the step's tokens over the context and themselves.

        Parameters
        ----------
        layer : int
            Layer index.
        q : torch.Tensor
            ``[B, Hq, L, D]`` post-RoPE queries.
        k, v : torch.Tensor
            ``[B, Hkv, L, D]`` post-RoPE keys and values of the same tokens.
        valid : torch.Tensor | None
            ``[B, L]`` bool, ``False`` for padding; ``None`` = no padding.
        scale : float | None
            Softmax scale, ``1/sqrt(D)`` by default.
        softcap : float | None
            Attention logit soft-cap (Gemma 2's ``attn_logit_softcapping``): every score
            ``x`` becomes ``softcap * tanh(x / softcap)``, in prefill and decode; ``None``
            (default): no cap.

        Returns
        -------
        torch.Tensor
            ``[B, Hq, L, D]`` in ``q``'s dtype.

        Raises
        ------
        InvalidValueError
            ``softcap`` is not ``None`` or a finite positive number.
        """
        self._check(q, k, v, valid)
        softcap = check_softcap(softcap)
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        L = q.shape[2]
        if L == 1 and any(s.tokens(layer) > 0 for s in self.seqs):
            self.release()
            if layer in self._prefilled:
                # the prompt's tokens but the last window are indexed before decoding, so
                # the rows' steady zones are equally long (whatever their prompt lengths)
                self.store.seal(self.seqs, layer)
                self._prefilled.discard(layer)
            out, stats = decode(self.store, self.seqs, layer, q, k, v, scale=scale, valid=valid,
                                softcap=softcap)
            if stats is not None:
                # kept as is: folding reads deferred stats back, a host sync per step
                self._pending.append(stats)
                if len(self._pending) >= _MAX_PENDING:
                    self._fold()
            return out
        out = prefill(self.store, self.seqs, layer, q, k, v, scale=scale, valid=valid,
                      softcap=softcap, mirror=self.mirror)
        self._prefilled.add(layer)
        return out

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               valid: torch.Tensor | None) -> None:
        first = self.seqs[0]
        B, Hkv, D = len(self.seqs), first.num_kv_heads, first.head_dim
        check_tensor(k, "k", shape=(B, Hkv, None, D), dtype=first.dtype)
        L = k.shape[2]
        check_tensor(v, "v", shape=(B, Hkv, L, D), dtype=first.dtype)
        check_tensor(q, "q", shape=(B, None, L, D), dtype=first.dtype)
        group_size(q.shape[1], Hkv)
        if L == 0:
            raise ShapeError("k: expected at least one token, got 0")
        if valid is not None:
            check_tensor(valid, "valid", shape=(B, L), dtype=torch.bool)
