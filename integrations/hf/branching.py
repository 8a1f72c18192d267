"""The row operations and cropping of a :class:`~integrations.hf.cache.WaveCache`.

transformers calls them on the cache as a whole: ``reorder_cache`` (beam search),
``batch_select_indices``, ``batch_repeat_interleave``, ``activate_past_recording`` and
``crop`` (assisted decoding). The sliding-window layers apply them to their own tensors;
the store layers switch to :class:`~integrations.hf.beams.Branches` the first time, and
stay there for the cache's life.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from integrations.hf.beams import Branches, crop_error
from integrations.hf.window_cache import WindowLayer
from vecstore.errors import InvalidValueError

if TYPE_CHECKING:
    from attention import StoreAttention
    from vecstore import Store

__all__ = ["BranchingMixin"]


class BranchingMixin:
    """Row operations and cropping for a cache of store layers and window layers."""

    if TYPE_CHECKING:
        layers: list[Any]
        name: str
        store: Store
        _attention: StoreAttention | None
        _branches: Branches | None
        _recording: bool

        def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def _store_layers(self) -> list[Any]:
        return [layer for layer in self.layers if not isinstance(layer, WindowLayer)]

    def _rows(self) -> int:
        if self._branches is not None:
            return len(self._branches.parents)
        return len(self._attention.seqs) if self._attention is not None else 0

    def _branched(self, *, commit: bool) -> Branches | None:
        """The branches of the store layers, created on first use (``None`` while the
        cache holds no rows)."""
        if self._branches is None and self._attention is not None:
            self._branches = Branches(len(self._store_layers()), len(self._attention.seqs),
                                      commit=commit)
            self._attention.release()  # the branches attend from now on, never a prefill
        return self._branches

    def _select_rows(self, index: torch.Tensor) -> None:
        index = torch.as_tensor(index, dtype=torch.long).flatten()
        rows = self._rows()
        if index.numel() and rows and (int(index.min()) < 0 or int(index.max()) >= rows):
            raise InvalidValueError(f"rows: indices must be in [0, {rows}), got "
                                    f"{index.tolist()}")
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                layer.select_rows(index)
        branches = self._branched(commit=False)
        if branches is None:
            return
        branches.select(index)
        assert self._attention is not None
        kept = set(branches.parents)
        for i, seq in enumerate(self._attention.seqs):
            if i not in kept and not seq.is_dropped and seq.name.startswith(f"{self.name}."):
                self.store.drop(seq.name)  # no row descends from it any more

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``r`` continues from row ``beam_idx[r]``. Beams share their
        stored prefix; each keeps its own tokens since then."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices``, in that order."""
        self._select_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (the copies share its stored prefix)."""
        self._select_rows(torch.arange(self._rows()).repeat_interleave(repeats))

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Keep each forward pass's tokens outside the store until :meth:`crop` (or the
        next pass) settles them, so that they can be cropped; transformers calls this
        before assisted decoding. ``recurrent_states_to_keep`` (passed by transformers
        5.25 and later) is for layers with recurrent states; attention layers keep none."""
        self._recording = True
        self._branched(commit=True)

    def crop(self, max_length: int) -> None:
        """Remove the last ``-max_length`` tokens (a positive ``max_length`` keeps that
        many); the tokens kept then enter the store.

        Only the latest forward pass's tokens can be removed, and from the store layers
        only after :meth:`activate_past_recording`.

        Raises
        ------
        IncompatibleError
            If some of the tokens to remove are in the store (or left a sliding window)
            already; nothing changes then.
        """
        n = self.get_seq_length() - max_length if max_length > 0 else -max_length
        store_layers = self._store_layers()
        branches = self._branched(commit=True) if n > 0 or self._recording else None
        if n > 0:
            for slot in range(len(store_layers)):
                held = 0 if branches is None else branches.tail_length(slot)
                if held < n:
                    raise crop_error(n, held)
            windows = [layer for layer in self.layers if isinstance(layer, WindowLayer)]
            for window in windows:
                window.check_crop(n)
            for window in windows:
                window.crop(-n)
            for slot, layer in enumerate(store_layers):
                assert branches is not None
                branches.crop(slot, n)
                layer.seen -= n
        if branches is not None and self._attention is not None:
            for slot in range(len(store_layers)):
                branches.commit(self.store, self._attention.seqs, slot)
