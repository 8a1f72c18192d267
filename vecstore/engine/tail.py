"""One buffer for the steady zones of a batch's rows: each row's sinks, then its pending
tail, at fixed capacity, so a decode step appends with two copies for the whole batch and
the batch's steady zone is the buffer itself (no concatenation, fixed shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TailBuffer", "writing"]


def writing(t: torch.Tensor) -> torch.inference_mode:
    """A context in which ``t`` may be updated in place whether or not the caller is in
    inference mode: tensors made under ``torch.inference_mode`` (a prefill there) may only
    be written there, others anywhere."""
    return torch.inference_mode(t.is_inference())


@dataclass(eq=False, slots=True)
class TailBuffer:
    """``[B, Hkv, sinks + capacity, D]`` keys and values: row ``b`` holds its layer's
    ``sinks`` sink tokens, then its pending tail, the view ``keys[b, :, sinks:sinks + n]``
    (and ``values[...]``) of that layer. Columns past a row's tokens are unused."""

    keys: torch.Tensor
    values: torch.Tensor
    sinks: int
    _lengths: torch.Tensor | None = None
    _filled: int = -1  # what ``_lengths`` holds

    def lengths(self, n: int) -> torch.Tensor:
        """``[B]`` int64 on the buffer's device: ``sinks + n`` for every row. The same tensor
        each time (filled again only when ``n`` changes), so a captured step may read it in
        place."""
        if self._lengths is None:
            self._lengths = torch.empty(self.keys.shape[0], dtype=torch.long,
                                        device=self.keys.device)
        if self._filled != n:
            with writing(self._lengths):
                self._lengths.fill_(self.sinks + n)
            self._filled = n
        return self._lengths

    @property
    def capacity(self) -> int:
        """Tail tokens a row can hold."""
        return self.keys.shape[2] - self.sinks

    def row(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[Hkv, n, D]`` views of row ``b``'s first ``n`` tail tokens (keys, values)."""
        end = self.sinks + n
        return self.keys[b, :, self.sinks:end], self.values[b, :, self.sinks:end]

    def holds_row(self, b: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys, values`` (a layer's tail) are views starting at row ``b``'s first
        tail column."""
        size = self.keys.element_size()
        at = b * self.keys.stride(0) * size + self.sinks * self.keys.stride(2) * size
        return (keys.data_ptr() == self.keys.data_ptr() + at
                and values.data_ptr() == self.values.data_ptr() + at)
