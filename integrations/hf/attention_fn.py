"""The attention and mask functions registered with transformers under ``"vecstore"``.

transformers builds one mask per forward pass (through ``AttentionMaskInterface``) and
calls the attention function of every layer (through ``AttentionInterface``) with the
layer's post-RoPE ``query, key, value`` and that mask. Here:

- :func:`vecstore_mask` returns a :class:`StepMask`: the 2-D padding mask, from which
  the new tokens' validity is read, and, built only if some layer needs it, the dense
  boolean mask transformers' ``sdpa`` would have used.
- :func:`vecstore_attention` hands the step to the :class:`~integrations.hf.cache.WaveCache`
  that staged it in ``cache.update`` (found through the module's
  :class:`~integrations.hf.install.ModelBinding`); with no such cache it runs
  transformers' ``sdpa`` attention on the dense mask, unchanged, or, for a model that
  soft-caps its logits (the ``softcap`` transformers passes, Gemma 2's
  ``attn_logit_softcapping``), :func:`attention.exact.capped_attention` on that mask.
  The cache's layers get the ``softcap`` too.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import prepare_padding_mask, sdpa_mask

from attention.exact import capped_attention
from vecstore.errors import IncompatibleError

__all__ = ["StepMask", "vecstore_mask", "vecstore_attention", "BINDING_ATTR"]

BINDING_ATTR = "_vecstore_binding"
"""Attribute holding a :class:`~integrations.hf.install.ModelBinding` on bound modules."""


class StepMask:
    """The mask of one forward pass, shared by all its layers.

    Parameters
    ----------
    padding : torch.Tensor | None
        ``[B, kv_length]`` bool, ``False`` for padding; ``None`` = no padding.
    kv_length : int
        Tokens seen by the cache after this step (past + new, padding included).
    sdpa_kwargs : dict
        The arguments of transformers' ``sdpa_mask``, for :meth:`dense`.
    """

    __slots__ = ("padding", "kv_length", "_sdpa_kwargs", "_dense", "_built", "_valid")

    def __init__(self, padding: torch.Tensor | None, kv_length: int,
                 sdpa_kwargs: dict[str, Any]) -> None:
        self.padding = padding
        self.kv_length = kv_length
        self._sdpa_kwargs = sdpa_kwargs
        self._dense: torch.Tensor | None = None
        self._built = False
        self._valid: dict[int, torch.Tensor | None] = {}

    def valid_new(self, num_new: int) -> torch.Tensor | None:
        """``[B, num_new]`` bool validity of the step's tokens, ``None`` if all are valid.

        Worked out once per forward pass (it reads the mask back: a host sync), not once
        per layer.
        """
        if self.padding is None:
            return None
        if num_new not in self._valid:
            valid = self.padding[:, self.kv_length - num_new:self.kv_length].bool()
            self._valid[num_new] = None if bool(valid.all()) else valid
        return self._valid[num_new]

    def dense(self) -> torch.Tensor | None:
        """The ``[B, 1, L, kv_length]`` mask transformers' ``sdpa`` uses (``None`` = causal)."""
        if not self._built:
            self._dense, self._built = sdpa_mask(**self._sdpa_kwargs), True
        return self._dense


def vecstore_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                  kv_offset: int = 0, attention_mask: torch.Tensor | None = None,
                  **kwargs: Any) -> StepMask:
    """Mask function registered with ``AttentionMaskInterface`` (signature of ``sdpa_mask``).

    Returns
    -------
    StepMask
        Passed by the model to every layer's attention function.
    """
    sdpa_kwargs = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                       q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                       **kwargs)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None and kv_offset:
        padding = padding[:, kv_offset:]
    return StepMask(padding, kv_length, sdpa_kwargs)


def vecstore_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                       scaling: float | None = None, **kwargs: Any,
                       ) -> tuple[torch.Tensor, None]:
    """Attention function registered with ``AttentionInterface``.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (``layer_idx`` names the layer).
    query : torch.Tensor
        ``[B, Hq, L, D]`` post-RoPE queries.
    key, value : torch.Tensor
        ``[B, Hkv, L, D]`` what ``cache.update`` returned: with a ``WaveCache``, the
        step's own keys and values (the context lives in the store).
    attention_mask : StepMask | torch.Tensor | None
        From :func:`vecstore_mask`, or a user-provided 4-D mask.
    **kwargs
        What the model passes besides; ``softcap`` (a float, or ``None``) soft-caps the
        attention logits.

    Returns
    -------
    tuple[torch.Tensor, None]
        ``[B, L, Hq, D]`` output and no attention weights.
    """
    binding = getattr(module, BINDING_ATTR, None)
    cache = binding.take(module.layer_idx) if binding is not None else None
    softcap = kwargs.get("softcap")
    if cache is None:
        dense = attention_mask.dense() if isinstance(attention_mask, StepMask) else attention_mask
        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout,
                                          scaling=scaling, **kwargs)
        if dropout:
            raise IncompatibleError("vecstore's attention with soft-capped logits is for "
                                    "inference: no attention dropout")
        out = capped_attention(query, key, value, softcap=softcap, mask=dense,
                               scale=scaling if scaling is not None else query.shape[-1] ** -0.5)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and not isinstance(attention_mask, StepMask):
        raise IncompatibleError("attention_mask: WaveCache takes 2-D padding masks only, got a "
                                f"{attention_mask.dim()}-D mask")
    if dropout or kwargs.get("sliding_window") is not None:
        raise IncompatibleError("WaveCache supports inference with full attention only "
                                "(no attention dropout, no sliding window)")
    valid = attention_mask.valid_new(query.shape[2]) if attention_mask is not None else None
    out = cache.attend(module.layer_idx, query, key, value, valid=valid, scale=scaling,
                       softcap=softcap)
    return out.transpose(1, 2).contiguous(), None
