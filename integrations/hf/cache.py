"""WaveCache: a transformers ``Cache`` whose KV lives in a vecstore store.

Creating a ``WaveCache`` for a model attaches it (through :func:`~integrations.hf.install.install`):
the model's attention implementation becomes ``"vecstore"`` until the cache is closed
(``close()``, a ``with`` block, or garbage collection), so
``model.generate(ids, cache=WaveCache(None, model))`` works as is. Several
caches may be open on one model; a forward pass with another cache (or none) runs
transformers' ``sdpa`` attention unchanged.

Each layer's ``update`` stages the step's keys and values and returns them untouched;
the layer's attention function then hands queries, keys, values and the tokens'
validity to :class:`attention.StoreAttention`, which prefills (exact attention, then
ingestion into the store) or decodes (append, then ``store.query``). Each batch row is
one :class:`vecstore.Sequence`; padding is never stored.
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from transformers import Cache, PreTrainedModel

from attention import DecodeStats, StoreAttention
from integrations.hf.branching import BranchingMixin
from integrations.hf.cache_arg import cache_kwarg
from integrations.hf.cache_layer import WaveCacheLayer
from integrations.hf.cache_setup import create_rows, decode_graphs, place_rows, store_config
from integrations.hf.capabilities import check_sequence
from integrations.hf.decode_graph import DecodeGraph, graphed_forward
from integrations.hf.install import (
    ATTENTION_NAME,
    ModelShape,
    install,
    model_fingerprint,
    model_shape,
)
from integrations.hf.model_stats import ModelDecodeStats, model_decode_stats
from integrations.hf.window_cache import WindowLayer
from vecstore import Sequence, Store, StoreConfig
from vecstore.engine.decoder import BatchDecoder
from vecstore.errors import IncompatibleError, ShapeError, StoreClosedError

__all__ = ["WaveCache", "WaveCacheLayer", "cache_kwarg"]


class WaveCache(BranchingMixin, Cache):
    """A transformers cache backed by a vecstore store (RetroInfer's wave index).

    Parameters
    ----------
    store_or_config : Store | StoreConfig | dict | str | Path | None
        An open store (left open by :meth:`close`), or the configuration of a new
        in-memory store (``None`` = defaults, on the model's device).
    model : PreTrainedModel
        A decoder that passes :func:`~integrations.hf.capabilities.model_shape`'s checks
        (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3 and others). Its full-attention layers
        go through the store; its sliding-window layers keep their window exactly, in
        memory (:class:`~integrations.hf.window_cache.WindowLayer`).
    name : str, optional
        Sequence name in the store (a random one by default); batch row ``b`` of a
        batch of several is stored as ``"<name>.<b>"``.
    cuda_graphs : bool, optional
        Run decode steps as one CUDA graph of the model's whole forward
        (:mod:`integrations.hf.decode_graph`): a step is then one launch, whatever the
        number of layers. ``None`` (default): on when the model is on a CUDA device. On a
        CPU, ``True`` runs the same fixed-shape steps without capture. Only in-memory
        stores decode this way (a persisted store commits every step).
    compile_layers : bool
        Run the fixed-shape decode steps with the model's decoder layers compiled around
        their attention (:class:`~integrations.hf.layer_compile.CompiledLayers`:
        ``torch.compile`` fuses the norms, residual adds and activations; the attention
        modules run as they are). The first step of each batch size compiles (seconds to
        a minute); needs ``cuda_graphs``. Default ``False``.

    Raises
    ------
    IncompatibleError
        Naming what the model lacks (see :mod:`integrations.hf.capabilities`).

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> with WaveCache(None, model) as cache:
    ...     out = model.generate(torch.tensor([[1, 2, 3]]), cache=cache,
    ...                          max_new_tokens=3, do_sample=False, pad_token_id=0)
    ...     cache.get_seq_length(), cache.sequences[0].num_tokens
    (5, 5)
    >>> model.config._attn_implementation
    'sdpa'
    """

    def __init__(self, store_or_config: Store | StoreConfig | Mapping[str, Any] | str | Path
                 | None = None, model: PreTrainedModel | None = None, *,
                 name: str | None = None, cuda_graphs: bool | None = None,
                 compile_layers: bool = False) -> None:
        shape = model_shape(model)
        assert model is not None  # model_shape raised otherwise
        cuda_graphs = decode_graphs(cuda_graphs, compile_layers, shape.device)
        if isinstance(store_or_config, Store):
            store, owned = store_or_config, False
        else:
            store, owned = Store.open(config=store_config(store_or_config, shape)), True
        self._setup(store, owned, model, shape, name or f"hf-{secrets.token_hex(4)}", None,
                    cuda_graphs, compile_layers)

    def _setup(self, store: Store, owned: bool, model: PreTrainedModel, shape: ModelShape,
               name: str, resumed: Sequence | None, cuda_graphs: bool,
               compile_layers: bool) -> None:
        self.store = store
        self.name = name
        self.shape = shape
        self.fingerprint = model_fingerprint(model)
        if resumed is not None:
            check_sequence(resumed, shape, self.fingerprint)
            place_rows(resumed, shape)
        seen = resumed.num_tokens if resumed is not None else 0
        self._slots = {layer: slot for slot, layer in enumerate(shape.store_layers)}
        windows = shape.windows or (None,) * shape.num_layers
        super().__init__(layers=[WaveCacheLayer(self, i, seen) if w is None else WindowLayer(w)
                                 for i, w in enumerate(windows)])
        self._branches = None
        self._recording = False
        self._model = model
        self._attention = StoreAttention(store, [resumed]) if resumed is not None else None
        self._route: BatchDecoder | None = None
        stack = ExitStack()
        if owned:
            stack.callback(store.close)
        self._binding = stack.enter_context(install(model))
        self.graph: DecodeGraph | None = None
        if cuda_graphs:
            self.graph = stack.enter_context(graphed_forward(model, self,
                                                             compile_layers=compile_layers))
        self._finalizer = weakref.finalize(self, stack.close)

    @classmethod
    def from_store(cls, store_or_path: Store | str | Path, name: str, model: PreTrainedModel, *,
                   config: StoreConfig | Mapping[str, Any] | str | Path | None = None,
                   cuda_graphs: bool | None = None,
                   compile_layers: bool = False) -> WaveCache:
        """Continue from a sequence stored earlier, without prefilling it again.

        Pass the full token ids (the stored context's, then the new ones) to
        ``generate``, which feeds the model only those past ``get_seq_length()``.

        Parameters
        ----------
        store_or_path : Store | str | Path
            An open store, or the path of a persisted one (opened with ``config`` and
            closed with the cache).
        name : str
            The stored sequence.
        model : PreTrainedModel
            Must be the model that built the sequence.
        config : StoreConfig | dict | str | Path, optional
            The configuration a store opened from ``store_or_path`` gets.
        cuda_graphs : bool, optional
            As for the constructor.
        compile_layers : bool
            As for the constructor.

        Raises
        ------
        NotFoundError
            If the store has no sequence ``name``.
        IncompatibleError
            If the sequence was built for a different model (fingerprint or shape).
        """
        shape = model_shape(model)
        cuda_graphs = decode_graphs(cuda_graphs, compile_layers, shape.device)
        owned = not isinstance(store_or_path, Store)
        store = Store.open(store_or_path, config) if owned else store_or_path
        assert isinstance(store, Store)
        try:
            seq = store.sequence(name)
            cache = cls.__new__(cls)
            cache._setup(store, owned, model, shape, name, seq, cuda_graphs, compile_layers)
        except BaseException:
            if owned:
                store.close()
            raise
        return cache

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Detach from the model (restoring its attention), free what the prompt's prefill
        holds on the device and close an owned store."""
        if self._attention is not None:
            self._attention.release()
        self._finalizer()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return not self._finalizer.alive

    def __enter__(self) -> WaveCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the model and attention function call --------------------------------------
    @torch.compiler.disable  # the layers compile around it (integrations.hf.layer_compile)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' ``Cache.update`` (each layer stages its step), opaque to
        ``torch.compile``."""
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def stage(self, layer: int) -> None:
        """Mark ``layer``'s next attention call as this cache's (from ``update``)."""
        if self.is_closed:
            raise StoreClosedError("this WaveCache was closed")
        impl = self._model.config._attn_implementation
        if impl != ATTENTION_NAME:
            raise IncompatibleError(
                f"the model's attention implementation is {impl!r}, not {ATTENTION_NAME!r}: "
                "WaveCache works only through vecstore's attention function, which it sets "
                "while open; do not change the implementation while a WaveCache is in use")
        self._binding.stage(self, layer)
        if self._branches is not None and self._attention is not None:
            self._branches.commit(self.store, self._attention.seqs, self._slots[layer])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               valid: torch.Tensor | None, scale: float | None,
               softcap: float | None = None) -> torch.Tensor:
        """Attention of one layer's step (``q [B, Hq, L, D]``, ``k, v [B, Hkv, L, D]``),
        its logits soft-capped by ``softcap`` (``None``: no cap).

        Returns ``[B, Hq, L, D]``; see :class:`attention.StoreAttention` (and
        :class:`~integrations.hf.beams.Branches` once rows were reordered or recording).
        """
        slot = self._slots[layer]
        if self._route is not None:
            return self._route.attend(slot, q, k, v, scale if scale is not None
                                      else q.shape[-1] ** -0.5, softcap)
        if self._attention is None:
            self._attention = StoreAttention(self.store, create_rows(
                self.store, self.name, q.shape[0], self.shape, self.fingerprint))
        elif self._branches is None and q.shape[0] != len(self._attention.seqs):
            raise ShapeError(f"batch: this WaveCache holds {len(self._attention.seqs)} rows, "
                             f"got a step with {q.shape[0]}")
        branches = self._branched(commit=True) if self._recording else self._branches
        if branches is not None:
            return branches.attend(self.store, self._attention.seqs, slot, q, k, v,
                                   valid=valid, scale=scale or q.shape[-1] ** -0.5,
                                   softcap=softcap)
        return self._attention(slot, q, k, v, valid=valid, scale=scale, softcap=softcap)

    @property
    def model(self) -> PreTrainedModel:
        """The model this cache is attached to."""
        return self._model

    def decoder(self, batch: int) -> BatchDecoder | None:
        """The batch's fixed-shape decode steps (:meth:`attention.StoreAttention.decoder`),
        or ``None``; for :class:`~integrations.hf.decode_graph.DecodeGraph`. Models with
        sliding-window layers (their windows grow by concatenation) and rows reordered or
        recorded for cropping (beams, assisted decoding) decode ordinarily."""
        if (self._attention is None or batch != len(self._attention.seqs)
                or self._branches is not None or self._recording
                or len(self._slots) != len(self.layers)):
            return None
        return self._attention.decoder(self.shape.num_q_heads)

    def route(self, decoder: BatchDecoder | None) -> None:
        """Send the attention calls to ``decoder`` (``None``: through the store again)."""
        self._route = decoder

    # -- inspection ----------------------------------------------------------------------
    @property
    def sequences(self) -> list[Sequence]:
        """The store sequences of the batch rows (empty before the first forward pass;
        after beam search, the ones some beam still descends from)."""
        seqs = self._attention.seqs if self._attention is not None else []
        return [s for s in seqs if not s.is_dropped]

    @property
    def decode_stats(self) -> ModelDecodeStats:
        """What the decode steps read exactly and estimated, summed over layers and steps,
        with the sliding-window layers reported apart."""
        base = self._attention.decode_stats if self._attention is not None else DecodeStats()
        return model_decode_stats(base, self._branches, self.shape, self.layers)

