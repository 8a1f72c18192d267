"""A batch's decode steps as fixed-shape device work that one CUDA graph can capture.

A :class:`BatchDecoder` serves every layer of a batch of in-memory sequences whose steady
zones share :class:`~vecstore.engine.tail.TailBuffer` s of equal tails. Per layer and step,
:meth:`BatchDecoder.attend` writes the new token's key and value into the buffer at a
column read from a device tensor, then runs the executor's fused step over the prepared
stacked view and the buffer (fixed capacity, lengths on the device), and adds the step's
stats and NaN/Inf check to device accumulators: device work only, no host sync, the same
shapes every step. :meth:`BatchDecoder.end` (device) closes the step, and
:meth:`BatchDecoder.advance` (host) then lets the sequences see the new token.

The step that would index the tail (every ``attention.update_tokens`` tokens) is not
one of these: :attr:`BatchDecoder.flush_due` says so, and the caller runs it through the
store's ordinary append and query, then builds a new decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vecstore.engine.layer_state import LayerState
from vecstore.engine.sequence import Sequence
from vecstore.engine.shared_tail import extend
from vecstore.engine.tail import TailBuffer, writing
from vecstore.errors import InvalidValueError
from vecstore.executor.base import Steady
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.executor.wave_state import PreparedView, add_step_stats, step_stats
from vecstore.executor.wave_streams import on
from vecstore.kernels.backend import resolve_backend

__all__ = ["BatchDecoder", "LayerStep", "flush_due"]

_NONE = 2**62  # no bad column seen


def flush_due(tail_tokens: int, window: int, update: int) -> bool:
    """Whether one more token makes tails of ``tail_tokens`` index a segment
    (``attention.window_tokens`` and ``attention.update_tokens``)."""
    return tail_tokens + 1 - window >= update


@dataclass(eq=False, slots=True)
class LayerStep:
    """What a decoder holds of one layer: the rows' states, their shared steady buffer,
    and the executor's prepared stacked view."""

    states: list[LayerState]
    tail: TailBuffer
    prep: PreparedView


class BatchDecoder:
    """Fixed-shape decode steps of ``seqs`` (built by :meth:`vecstore.engine.store.Store.decoder`).

    Parameters
    ----------
    executor : WaveExecutor
        Runs the fused step (:meth:`~vecstore.executor.wave_exec.WaveExecutor.decode`).
    seqs : list[Sequence]
        The batch's rows.
    layers : list[LayerStep]
        One per layer of the sequences.
    tail_tokens : int
        Tokens in every row's tail now.
    window, update : int
        ``attention.window_tokens`` and ``attention.update_tokens``.
    """

    def __init__(self, executor: WaveExecutor, seqs: list[Sequence], layers: list[LayerStep],
                 tail_tokens: int, window: int, update: int) -> None:
        self.executor = executor
        self.seqs = list(seqs)
        self.layers = layers
        self.tail_tokens = tail_tokens
        self.window, self.update = window, update
        first = layers[0].tail
        dev = first.keys.device
        B = first.keys.shape[0]
        self.sinks = first.sinks
        col = self.sinks + tail_tokens
        self.col = torch.full((1,), col, dtype=torch.long, device=dev)
        self.lengths = torch.full((B,), col + 1, dtype=torch.long, device=dev)
        self.finite = torch.ones(len(layers), dtype=torch.int32, device=dev)  # 0: a NaN/Inf
        self.bad_col = torch.full((1,), _NONE, dtype=torch.long, device=dev)
        self.stats = torch.zeros(len(layers), 5, dtype=torch.float64, device=dev)
        self.steps = 0  # steps advanced
        self._taken: tuple[int, torch.Tensor | None] = (0, None)  # by take_stats
        # the flag's host copy (pinned on CUDA), read without a device sync
        self._bad_host = torch.full((1,), _NONE, dtype=torch.long,
                                    pin_memory=dev.type == "cuda")
        self._bad_ready = torch.cuda.Event() if dev.type == "cuda" else None
        self._expect = [self._heads(step) for step in layers]
        # on CUDA one Triton launch per layer does the stats and the NaN/Inf check. It and
        # the write of the token into the tail run on a side stream: only the steady zone's
        # attention waits for the write (an event per layer), nothing waits for the stats.
        # What the side stream reads is held until end() joins it, so no later allocation
        # reuses that memory first
        self._fused = resolve_backend("auto", dev) == "triton"
        on_cuda = self._fused and dev.type == "cuda"
        self._side = torch.cuda.Stream(dev) if on_cuda else None
        self._written = [torch.cuda.Event() for _ in layers] if on_cuda else []
        self._side_reads: list[object] = []

    # -- host side -----------------------------------------------------------------------
    @property
    def flush_due(self) -> bool:
        """Whether the next step's token makes the tails index a segment (run it through
        the store's ordinary path, then build a new decoder)."""
        return flush_due(self.tail_tokens, self.window, self.update)

    def is_current(self) -> bool:
        """Whether the sequences are still exactly as this decoder left them (nothing
        appended, rolled back, sealed or dropped around it)."""
        return all(not s.is_dropped for s in self.seqs) and all(
            _mark(st) is k and st.version == v
            for step, expect in zip(self.layers, self._expect, strict=True)
            for st, (k, v) in zip(step.states, expect, strict=True))

    def begin(self) -> None:
        """Before a step's device work: raise for an earlier step that stored a NaN/Inf
        (see :meth:`check`), and let offloaded layers' block caches take their policy's
        newest victims."""
        self.check()
        for step in self.layers:
            if step.prep.buffer is not None:
                step.prep.buffer.begin_step()

    def advance(self) -> None:
        """After a step's device work was issued (run or replayed): every row's tail holds
        the new token, and offloaded layers' block caches queue the step's record."""
        self.tail_tokens += 1
        for step in self.layers:
            extend(step.tail, step.states, self.tail_tokens)
            if step.prep.buffer is not None:
                step.prep.buffer.finish_step()
        self._expect = [self._heads(step) for step in self.layers]
        self.steps += 1
        with writing(self._bad_host):
            self._bad_host.copy_(self.bad_col, non_blocking=True)
        if self._bad_ready is not None:
            self._bad_ready.record()

    def check(self, *, wait: bool = False) -> None:
        """Raise :class:`~vecstore.errors.InvalidValueError` if a step's keys, values or
        queries held a NaN or Inf, after removing that step's token and every later one
        from the tails (the store is as it was before it). The flag is read without
        waiting for the device (a step or so late) unless ``wait``."""
        ready = self._bad_ready
        if ready is not None:
            if wait:
                ready.synchronize()
            elif not ready.query():
                return
        # host memory read as bytes: no tensor op, so nothing can wait for the device
        bad = int.from_bytes(bytes(self._bad_host.untyped_storage()), "little", signed=True)
        if bad == _NONE:
            return
        dropped = self.sinks + self.tail_tokens - bad
        self._truncate(bad - self.sinks)
        raise InvalidValueError(
            f"a decode step's q, keys or values hold NaN or Inf (tail token {bad - self.sinks}"
            f" of layer 0 on): its {dropped} token(s) were not stored; check the model's "
            "inputs and dtype")

    def take_stats(self) -> tuple[int, torch.Tensor]:
        """``(queries, [5] float64 sums on the device)`` of the stats since the last call:
        the :class:`~vecstore.types.QueryStats` fields summed over layers and steps (the
        estimated mass too: divide by ``queries`` for its mean)."""
        steps, before = self._taken
        totals = self.stats.sum(dim=0)
        self._taken = (self.steps, totals)
        queries = (self.steps - steps) * len(self.layers)
        return queries, totals if before is None else totals - before

    def _truncate(self, tail_tokens: int) -> None:
        """Tails back to ``tail_tokens`` tokens; later columns zeroed, the flags reset."""
        self.tail_tokens = tail_tokens
        col = self.sinks + tail_tokens
        with writing(self.col):
            for step in self.layers:
                step.tail.keys[:, :, col:].zero_()
                step.tail.values[:, :, col:].zero_()
                extend(step.tail, step.states, tail_tokens)
            self.col.fill_(col)
            self.lengths.fill_(col + 1)
            self.finite.fill_(1)
            self.bad_col.fill_(_NONE)
            self._bad_host.fill_(_NONE)
        self._expect = [self._heads(step) for step in self.layers]

    @staticmethod
    def _heads(step: LayerStep) -> list[tuple[object, int]]:
        return [(_mark(st), st.version) for st in step.states]

    # -- device side (capturable) --------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        """Store the step's token of ``layer`` and attend to everything stored, the scores
        soft-capped by ``softcap`` (``None``: no cap).

        ``q [B, Hq, 1, D]``, ``k, v [B, Hkv, 1, D]`` (the sequences' dtype, on their
        device); returns ``[B, Hq, 1, D]``. Device work only.
        """
        step = self.layers[layer]
        tail = step.tail
        side, written = self._side, None
        with writing(self.col):
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(q.device))
                self._side_reads.append((q, k, v))
                written = self._written[layer]
            with on(side):
                tail.keys.index_copy_(2, self.col, k)
                tail.values.index_copy_(2, self.col, v)
                if written is not None:
                    written.record()
            res = self.executor.decode(step.prep, Steady(tail.keys, tail.values,
                                                         self.lengths), q[:, :, 0], scale,
                                       softcap, written)
            H = tail.keys.shape[1]  # step_stats counts tokens per KV head
            if self._fused:
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(q.device))
                    self._side_reads.append(res)
                with on(side):
                    add_step_stats(res, self.lengths, step.prep.tokens_total, H,
                                   self.stats[layer], (q, k, v), self.finite[layer])
            else:
                self.finite[layer] = torch.isfinite(torch.cat([q.flatten(), k.flatten(),
                                                               v.flatten()])).all()
                self.stats[layer].add_(step_stats(res, self.lengths, step.prep.tokens_total,
                                                  H))
        return res.out[:, :, None]

    def end(self) -> None:
        """Close a step on the device: note its column if anything was not finite, and
        move the write column on. Device work only."""
        if self._side is not None:
            torch.cuda.current_stream(self.col.device).wait_stream(self._side)
            self._side_reads.clear()
        with writing(self.col):
            bad = torch.where(self.finite.all(), _NONE, self.col)
            torch.minimum(self.bad_col, bad, out=self.bad_col)
            self.finite.fill_(1)
            self.col += 1
            self.lengths += 1


def _mark(state: LayerState) -> object:
    """What identifies ``state``'s tail as it is now, without slicing it: where in a batch's
    buffer it is read from, else its own keys."""
    at = state.tail_at
    return at if at is not None else state.pending_keys
