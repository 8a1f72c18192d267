"""The sliding-window layers of a :class:`~integrations.hf.cache.WaveCache`.

A sliding-window layer (Mistral, Phi-3 with ``sliding_window``, Gemma 2/3's local layers)
only ever attends to its last ``window`` positions, so it needs no store and no index:
:class:`WindowLayer` keeps those positions exactly, as transformers'
``DynamicSlidingWindowLayer`` does, and the layer's attention runs transformers' own
attention on them. It also keeps the previous step's tokens until the next one, so the
last step can be cropped (assisted decoding), and counts what its decode steps read.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import CacheLayerMixin

from vecstore.errors import IncompatibleError

__all__ = ["WindowLayer"]


class WindowLayer(CacheLayerMixin):
    """An exact cache of a sliding-window layer's last ``window - 1`` positions.

    ``keys``/``values`` are ``[B, Hkv, n, D]``, padding included (as transformers' masks
    count positions). ``update`` returns the visible keys (``window - 1`` before the
    step's tokens, and the step's own), the same tensors ``DynamicSlidingWindowLayer``
    returns, so attention over them is the model's own.

    Parameters
    ----------
    window : int
        The layer's ``sliding_window``.

    Examples
    --------
    >>> layer = WindowLayer(4)
    >>> k = torch.randn(1, 2, 6, 8)
    >>> layer.update(k, k)[0].shape[2], layer.get_seq_length(), layer.get_mask_sizes(1)
    (6, 6, (4, 3))
    >>> layer.update(k[:, :, :1], k[:, :, :1])[0].shape[2], layer.decode_tokens
    (4, 4)
    """

    is_sliding = True
    is_croppable = True

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.seen = 0  # positions seen, padding included
        self.last = 0  # tokens of the latest update (kept for a crop)
        self.decode_queries = 0
        self.decode_tokens = 0  # keys attended by decode steps, summed

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def _visible(self) -> int:
        return min(self.seen, self.window - 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the step's tokens; returns the keys and values the step attends to."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keep = self._visible()
        assert self.keys is not None and self.values is not None
        keys = torch.cat([self.keys[:, :, self.keys.shape[2] - keep:], key_states], dim=2)
        values = torch.cat([self.values[:, :, self.values.shape[2] - keep:], value_states],
                           dim=2)
        self.keys, self.values = keys, values
        self.seen += key_states.shape[2]
        self.last = key_states.shape[2]
        if self.last == 1:
            self.decode_queries += 1
            self.decode_tokens += keys.shape[2]
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        visible = self._visible()
        return visible + query_length, self.seen - visible

    def get_max_length(self) -> int:
        return self.window

    def check_crop(self, n: int) -> None:
        """Raise unless the last ``n`` positions can be forgotten: at most the latest
        step's, or any while the window is not full."""
        held = 0 if self.keys is None else self.keys.shape[2]
        if n > self.seen or held - n < min(self.seen - n, self.window - 1):
            raise IncompatibleError(
                f"cannot crop {n} tokens from a sliding-window layer (window {self.window}) "
                f"that keeps the latest step's {self.last}: the positions before them left "
                "the window")

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (see :meth:`check_crop`)."""
        n = -tokens_to_remove
        if n <= 0 or not self.is_initialized:
            return
        self.check_crop(n)
        assert self.keys is not None and self.values is not None
        held = self.keys.shape[2]
        self.keys, self.values = self.keys[:, :, :held - n], self.values[:, :, :held - n]
        self.seen -= n
        self.last = max(0, self.last - n)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (in that order; repeats allowed)."""
        if self.is_initialized:
            assert self.keys is not None and self.values is not None
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
            self.values = self.values.index_select(0, index.to(self.values.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            assert self.keys is not None
            self.select_rows(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.seen = self.last = 0
