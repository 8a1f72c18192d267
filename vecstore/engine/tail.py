"""One buffer for the steady zones of a batch's rows: each row's sinks, then its pending
tail, at fixed capacity, so a decode step appends with two copies for the whole batch and
the batch's steady zone is the buffer itself (no concatenation, fixed shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PendingTail", "TailBuffer", "TailHolder", "writing"]


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


class PendingTail:
    """A layer's pending tail: tensors of its own, or row ``row``'s first ``n`` tail tokens
    of a :class:`TailBuffer`, sliced only when read.

    A decode step moves the tail of every row and layer of a batch on by a token; slicing
    views for each (two select-and-slice chains) cost the host ~7 µs a row and layer a step
    on the H200, for views nothing reads until the next segment or a sub-batch's append.

    Examples
    --------
    >>> buf = TailBuffer(torch.arange(12.).view(1, 1, 12, 1), torch.zeros(1, 1, 12, 1), 2)
    >>> tail = PendingTail(torch.zeros(1, 0, 1), torch.zeros(1, 0, 1))
    >>> tail.follow(buf, 0, 3); tail.length, tail.keys.flatten().tolist()
    (3, [2.0, 3.0, 4.0])
    """

    __slots__ = ("_keys", "_values", "_at", "_stale")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.set(keys, values)

    def set(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make ``[Hkv, n, D]`` ``keys, values`` the tail (tensors of its own)."""
        self._keys, self._values = keys, values
        self._at: tuple[TailBuffer, int, int] | None = None
        self._stale = False

    def follow(self, buf: TailBuffer, row: int, n: int) -> None:
        """Make row ``row``'s first ``n`` tail tokens of ``buf`` the tail."""
        self._at = (buf, row, n)
        self._stale = True

    @property
    def at(self) -> tuple[TailBuffer, int, int] | None:
        """``(buffer, row, tokens)`` the tail is read from, or ``None`` (tensors of its own).
        The same object until the tail changes: a decoder compares it by identity."""
        return self._at

    @property
    def length(self) -> int:
        """Tokens in the tail (no slicing)."""
        return self._at[2] if self._at is not None else self._keys.shape[1]

    @property
    def keys(self) -> torch.Tensor:
        """``[Hkv, n, D]`` keys."""
        if self._stale:
            self._slice()
        return self._keys

    @property
    def values(self) -> torch.Tensor:
        """``[Hkv, n, D]`` values."""
        if self._stale:
            self._slice()
        return self._values

    def _slice(self) -> None:
        assert self._at is not None
        buf, row, n = self._at
        self._keys, self._values = buf.row(row, n)
        self._stale = False


class TailHolder:
    """The pending tail of a layer (:class:`vecstore.engine.layer_state.LayerState`), read
    through :class:`PendingTail`: its own tensors, or a batch's buffer's row."""

    _tail: PendingTail
    tail_buffer: TailBuffer | None

    @property
    def pending_keys(self) -> torch.Tensor:
        """``[Hkv, n, D]`` keys of the pending tail."""
        return self._pending().keys

    @property
    def pending_values(self) -> torch.Tensor:
        """``[Hkv, n, D]`` values of the pending tail."""
        return self._pending().values

    @property
    def tail_at(self) -> tuple[TailBuffer, int, int] | None:
        """``(buffer, row, tokens)`` of a tail read from a batch's buffer (the same object
        until the tail changes), else ``None``."""
        return self._pending().at

    def read_tail_from(self, buf: TailBuffer, row: int, n: int) -> None:
        """Make the pending tail the first ``n`` tail tokens of ``row`` of ``buf``
        (:mod:`vecstore.engine.shared_tail`), which the layer reads its tail from from now on."""
        self.tail_buffer = buf
        self._tail.follow(buf, row, n)

    def _pending(self) -> PendingTail:
        """The tail (a lazily loaded layer loads first)."""
        return self._tail
