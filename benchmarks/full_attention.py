"""Full attention the way serving engines run it, as a transformers cache: ``FullCache``.

The baseline of ``benchmarks/e2e.py`` (``../shared/BENCHMARKS.md``: the fastest way a user
could run the same job). What vLLM and SGLang do for one batch of sequences, in a
transformers ``Cache``:

- each layer's KV is preallocated once, ``[B, S, Hkv, D]`` (``S`` = the longest the run
  gets; token-major, the layout flash attention reads; :attr:`FullLayer.keys` is the same
  memory seen as transformers' ``[B, Hkv, S, D]``), and each step's keys and values are
  written in place at the current position -- no concatenation, no copy of the past;
- attention is flash attention over each row's filled length only
  (:func:`benchmarks.flash_varlen.flash_varlen`), through the attention function
  registered with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`; its
  mask function passes the 2-D padding mask through, so no mask is built per step;
- the decode step can be captured whole in one CUDA graph (:mod:`benchmarks.full_graph`):
  in a static step the write position is a device tensor and every length the kernel reads
  is computed on the device.

Left padding (what ``generate`` gives a batch of prompts of different lengths) is read
from the first forward pass's attention mask: row ``b`` then attends from its first real
token (``start[b]``) on, exactly, with no mask. Creating a cache switches the model's
attention implementation to :data:`ATTENTION_NAME` until :meth:`FullCache.close`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, Cache, CacheLayerMixin, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from benchmarks.flash_varlen import flash_varlen
from vecstore.errors import CapacityError, IncompatibleError, ShapeError

__all__ = ["ATTENTION_NAME", "FullCache", "FullLayer"]

ATTENTION_NAME = "serving_full"  # not "...flash...": transformers reads those as hub kernels
_BOUND = "_serving_full_cache"  # attribute of a bound attention module: weakref to its cache


@dataclass(frozen=True, slots=True)
class _Step:
    """What every layer's attention of one forward pass reads (set by layer 0's)."""

    cu_q: torch.Tensor
    seqused: torch.Tensor


class FullLayer(CacheLayerMixin):
    """One layer's preallocated KV: ``k``, ``v`` ``[B, S, Hkv, D]``, written in place."""

    is_sliding = False

    def __init__(self, owner: FullCache, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.k, self.v = k, v
        self.keys, self.values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D] views
        self.dtype, self.device = k.dtype, k.device
        self.seen = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the KV was allocated with the cache."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's ``[B, Hkv, L, D]`` keys and values at the current position."""
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)
        if k.shape[0] != self.k.shape[0]:
            raise ShapeError(f"batch: this FullCache holds {self.k.shape[0]} rows, got a "
                             f"forward pass of {k.shape[0]}")
        slots = self.owner.static_slots
        if slots is not None:  # a static step: the position is on the device
            self.k.index_copy_(1, slots, k)
            self.v.index_copy_(1, slots, v)
        else:
            L = k.shape[1]
            self.owner.check_room(self.seen, L)
            self.k[:, self.seen:self.seen + L] = k
            self.v[:, self.seen:self.seen + L] = v
            self.seen += L
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return self.k.shape[1]


class FullCache(Cache):
    """Preallocated KV for ``batch`` rows of up to ``max_len`` tokens, attended with flash
    attention over the filled length.

    Parameters
    ----------
    model : PreTrainedModel
        A Llama-family transformers model (attention modules with ``layer_idx``); its
        attention implementation is :data:`ATTENTION_NAME` until :meth:`close`.
    batch : int
        Rows; every forward pass must have this many.
    max_len : int
        Tokens a row may reach (prompt, padding included, plus generated).

    Raises
    ------
    CapacityError
        From a forward pass that would pass ``max_len``.
    IncompatibleError
        From a forward pass whose attention mask is not left padding.
    """

    def __init__(self, model: PreTrainedModel, batch: int, max_len: int) -> None:
        cfg = model.config
        param = next(model.parameters())
        Hkv = cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (batch, max_len, Hkv, D)
        kw = {"dtype": param.dtype, "device": param.device}
        # zeros, not empty: the CPU reference multiplies unfilled rows by zero weights
        super().__init__(layers=[FullLayer(self, torch.zeros(shape, **kw), torch.zeros(shape, **kw))
                                 for _ in range(cfg.num_hidden_layers)])
        self.batch, self.max_len, self.device = batch, max_len, param.device
        self.start = torch.zeros(batch, dtype=torch.long, device=param.device)
        self.cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=param.device)
        self._set_starts(self.start)
        self._cu_q: dict[int, torch.Tensor] = {}
        self.static_slots: torch.Tensor | None = None
        self.num_splits = 0  # of a decode step's keys (flash decoding); 0: the kernel's choice
        self.step: _Step | None = None
        self._finalizer = weakref.finalize(self, _bind(model, self))

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Give the model back its previous attention implementation."""
        self._finalizer()

    def __enter__(self) -> FullCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the layers and the attention function call -----------------------------------
    @torch.compiler.disable  # the layers compile around it (integrations.hf.layer_compile)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' ``Cache.update``, opaque to ``torch.compile``."""
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_room(self, seen: int, new: int) -> None:
        """Raise :class:`CapacityError` if ``new`` tokens after ``seen`` do not fit."""
        if seen + new > self.max_len:
            raise CapacityError(f"FullCache holds {self.max_len} tokens a row; {seen} are "
                                f"filled and the step brings {new}: create it with a larger "
                                "max_len")

    def begin(self, attention_mask: torch.Tensor | None, num_new: int) -> _Step:
        """Set the lengths of a forward pass of ``num_new`` tokens a row (layer 0's call,
        after its ``update``); a 2-D mask on the first pass sets each row's start. A
        refused mask leaves the cache as it was before the pass."""
        if self.static_slots is not None:
            end: torch.Tensor | int = self.static_slots[-1:] + 1
        else:
            end = self.layers[0].seen
            try:
                self._read_padding(attention_mask, first=end == num_new)
            except IncompatibleError:
                self.layers[0].seen -= num_new  # the pass did not happen
                raise
        if num_new not in self._cu_q:
            self._cu_q[num_new] = torch.arange(0, (self.batch + 1) * num_new, num_new,
                                               dtype=torch.int32, device=self.device)
        self.step = _Step(cu_q=self._cu_q[num_new], seqused=(end - self.start).to(torch.int32))
        return self.step

    def advance(self, tokens: int) -> None:
        """Count ``tokens`` written by static steps (whose layers count nothing)."""
        for layer in self.layers:
            layer.seen += tokens

    def _read_padding(self, mask: torch.Tensor | None, *, first: bool) -> None:
        """Check the pass's mask; on the first pass (the prompt) set each row's start."""
        if mask is None:
            return
        if mask.dim() != 2:
            raise IncompatibleError(f"attention_mask: FullCache takes a 2-D [batch, tokens] "
                                    f"padding mask, got shape {tuple(mask.shape)}")
        if not first:
            return
        mask = mask.bool()
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()):  # once, on the prompt
            raise IncompatibleError("attention_mask: FullCache takes left padding only (each "
                                    "row's zeros before its ones); pad on the left")
        self._set_starts(mask.shape[1] - mask.sum(-1))

    def _set_starts(self, start: torch.Tensor) -> None:
        self.start.copy_(start)
        rows = torch.arange(self.batch + 1, device=self.device) * self.max_len
        rows[:-1] += self.start
        self.cu_k.copy_(rows)


@torch.compiler.disable  # the layers compile around it (integrations.hf.layer_compile)
def full_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
                   ) -> tuple[torch.Tensor, None]:
    """Attention function registered under :data:`ATTENTION_NAME`: ``query [B, Hq, L, D]``
    over the layer's cache (``key``, ``value`` are its whole buffers); ``[B, L, Hq, D]``."""
    ref = getattr(module, _BOUND, None)
    cache = ref() if ref is not None else None
    if cache is None:
        raise IncompatibleError(f"attention implementation {ATTENTION_NAME!r} runs only with "
                                "the FullCache that set it; pass that cache to the model")
    if dropout or kwargs.get("sliding_window") is not None:
        raise IncompatibleError("FullCache runs inference with full attention only (no "
                                "dropout, no sliding window)")
    B, Hq, L, D = query.shape
    step = cache.begin(attention_mask, L) if module.layer_idx == 0 else cache.step
    layer = cache.layers[module.layer_idx]
    out = flash_varlen(query.transpose(1, 2).reshape(B * L, Hq, D), layer.k, layer.v,
                       cu_q=step.cu_q, cu_k=cache.cu_k, seqused=step.seqused, max_q=L,
                       causal=L > 1, scale=scaling if scaling is not None else D ** -0.5,
                       num_splits=cache.num_splits)
    return out.reshape(B, L, Hq, D), None


def passthrough_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any,
                     ) -> torch.Tensor | None:
    """Mask function registered under :data:`ATTENTION_NAME`: the 2-D padding mask as
    given (``None`` without one); the attention function needs no other mask."""
    return attention_mask


AttentionInterface.register(ATTENTION_NAME, full_attention)
AttentionMaskInterface.register(ATTENTION_NAME, passthrough_mask)


def _bind(model: PreTrainedModel, cache: FullCache):
    """Point ``model``'s attention modules at ``cache`` and switch its implementation;
    returns the callable that undoes both."""
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and hasattr(m, "num_key_value_groups")]
    if len(modules) != model.config.num_hidden_layers:
        raise IncompatibleError(f"model: found {len(modules)} attention modules for "
                                f"{model.config.num_hidden_layers} layers")
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    for m in modules:
        setattr(m, _BOUND, weakref.ref(cache))

    def unbind() -> None:
        for m in modules:
            if getattr(m, _BOUND, None) is not None:
                delattr(m, _BOUND)
        model.set_attn_implementation(previous)

    return unbind
