"""A store's data path: appends, seals, checked queries, fixed-shape decoders, memory."""

from __future__ import annotations

import torch

from vecstore.checks import check_softcap
from vecstore.engine.decoder import BatchDecoder
from vecstore.engine.sequence import Sequence
from vecstore.engine.store_core import StoreCore
from vecstore.types import QueryResult

__all__ = ["StoreData"]


class StoreData(StoreCore):
    """The data path of a :class:`~vecstore.engine.store.Store`: each call checks its arguments
    once, then runs in one transaction (writes) or one executor call (queries)."""

    def append_tokens(self, seq: Sequence, layer: int, keys: torch.Tensor,
                      values: torch.Tensor, *, whole_segments: bool = False) -> None:
        """Append validated tokens (called by :meth:`Sequence.append`); durable when it
        returns, unless inside :meth:`transaction`. ``whole_segments``: a prefill chunk,
        indexed in whole ``index.segment_tokens`` segments only."""
        with self._write() as txn:
            self._writer.append(txn, seq, layer, keys, values, whole_segments=whole_segments)

    def append_batch(self, seqs: list[Sequence], layer: int, keys: torch.Tensor,
                     values: torch.Tensor, *, finite: bool = True,
                     whole_segments: bool = False) -> None:
        """Append row ``b`` of ``keys, values`` to ``seqs[b]``, every row in one transaction.

        The batched :meth:`Sequence.append` (a decode step of a batch): the arguments are
        checked once for all rows, and a failed check stores nothing.

        Parameters
        ----------
        seqs : list[Sequence]
            ``B`` sequences of this store with the same KV heads, head_dim, dtype and
            device of ``layer``.
        layer : int
            Layer index.
        keys, values : torch.Tensor
            ``[B, Hkv, T, D]``, ``T >= 1``, of the sequences' dtype.
        finite : bool
            Scan ``keys`` and ``values`` for NaN/Inf first (one host sync on a GPU;
            ``False``: the caller did).
        whole_segments : bool
            A prefill chunk: index only whole ``index.segment_tokens`` segments, so a
            prompt fed in chunks is segmented as configured; the rest stays in the tail
            until a later append (the first decode step's at the latest) indexes it.

        Raises
        ------
        ShapeError, InvalidValueError, SequenceDroppedError
            Before anything is stored.

        Examples
        --------
        >>> from vecstore import Store
        >>> with Store.open() as store:
        ...     seqs = [store.create(n, num_layers=1, num_kv_heads=2, head_dim=8,
        ...                          dtype=torch.float32) for n in ("a", "b")]
        ...     store.append_batch(seqs, 0, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
        ...     [s.num_tokens for s in seqs]
        [3, 3]
        """
        self.check_open()
        keys, values = self._writer.check_batch(seqs, layer, keys, values, finite=finite)
        with self._write() as txn:
            self._writer.append_batch(txn, seqs, layer, keys, values,
                                      whole_segments=whole_segments)

    def seal(self, seqs: list[Sequence], layer: int) -> None:
        """Index every pending token of ``layer`` of ``seqs`` but the last
        ``attention.window_tokens``, however few (appends index only every
        ``attention.update_tokens``), in one transaction. A prefill ends with it, so the
        rows of a batch decode with equally long steady zones.

        Examples
        --------
        >>> from vecstore import Store
        >>> cfg = {"attention": {"sink_tokens": 2, "window_tokens": 4}}
        >>> with Store.open(config=cfg) as store:
        ...     seq = store.create("a", num_layers=1, num_kv_heads=1, head_dim=8,
        ...                        dtype=torch.float32)
        ...     seq.append(0, torch.randn(1, 40, 8), torch.randn(1, 40, 8))
        ...     before = seq.layers[0].num_indexed
        ...     store.seal([seq], 0)
        ...     before, seq.layers[0].num_indexed, seq.num_tokens
        (0, 34, 40)
        """
        self.check_open()
        self._queries.check_seqs(seqs, layer, stored=False)
        with self._write() as txn:
            self._writer.seal(txn, seqs, layer)

    def check_query(self, seqs: list[Sequence], layer: int, q: object,
                    scale: float | None, *, finite: bool = True,
                    grouped: bool = True) -> tuple[torch.Tensor, float]:
        """Validate a batched query; returns ``q`` grouped ``[B, Hkv, G, L, D]`` (float32)
        and the scale. ``finite=False`` skips the NaN/Inf scan of ``q`` (a host sync on a
        device) for a caller that checked it already; ``grouped=False`` returns ``q`` as
        given (not converted)."""
        self.check_open()
        return self._queries.check(seqs, layer, q, scale, finite=finite, grouped=grouped)

    def query(self, seqs: list[Sequence], layer: int, q: torch.Tensor, *,
              scale: float | None = None, finite: bool | None = None,
              softcap: float | None = None) -> QueryResult:
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
        finite : bool, optional
            Scan ``q`` for NaN/Inf first and raise :class:`InvalidValueError`. ``None``
            (default): on CPU tensors only, where it costs nothing; on a GPU the scan makes
            the host wait for the device every query, so there a NaN in ``q`` gives NaN
            rows of ``out`` (the store is unchanged either way) unless ``finite=True``.
        softcap : float, optional
            Attention logit soft-cap (Gemma 2's ``attn_logit_softcapping``): every score
            ``x`` (scaled) becomes ``softcap * tanh(x / softcap)`` before the softmax, in
            each zone; ``None`` (default): no cap.

        Returns
        -------
        QueryResult
            ``out [B, Hq, L, D]``, ``lse [B, Hq, L]``, stats summed over the batch.
        """
        if finite is None:
            finite = not (isinstance(q, torch.Tensor) and q.device.type == "cuda")
        # the grouped float32 copy of q is for search(); the executors take q as given
        self.check_open()
        _, scale = self._queries.check(seqs, layer, q, scale, finite=finite, grouped=False)
        return self._queries.run(seqs, layer, q, scale, check_softcap(softcap))

    def decoder(self, seqs: list[Sequence], num_q_heads: int) -> BatchDecoder | None:
        """Fixed-shape decode steps of ``seqs`` over every layer, for one CUDA graph of a
        model's whole decode forward (:class:`~vecstore.engine.decoder.BatchDecoder`), or ``None``
        when the batch does not qualify: the store is persisted (each step commits its
        tail), the executor is not the fused ``wave`` one or cannot run a layer, the rows'
        tails are not equally long behind full sinks (:meth:`seal` equalizes tails), or
        the next step indexes the tails. Rows that qualify share one steady buffer from
        then on. ``num_q_heads`` is the queries' head count.
        """
        self.check_open()
        return self._queries.decoder(seqs, num_q_heads)

    # -- memory --------------------------------------------------------------------------
    def memory(self) -> dict[str, tuple[int, int, int]]:
        """Bytes ``(in use, at peak, budget)`` of every memory budget in use, by name
        (``kvstore.pinned_budget_gb``, ``kvstore.gpu_budget_gb on <device>``; budget 0 =
        unbounded)."""
        return self.placement.usage()

