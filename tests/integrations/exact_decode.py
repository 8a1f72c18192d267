"""A stand-in for the wave executor's fused step that attends to every stored row exactly,
in plain torch: tests of the host side of the fused path (bookkeeping, buffers, capture)
run fast on CPU, and their tokens must equal full attention's. :data:`CPU_WAVE` is a small
store configuration for them, :func:`exact_wave_step` the fixture that puts the stand-in
in place (modules use it with ``pytest.mark.usefixtures``)."""

from __future__ import annotations

import pytest
import torch

from vecstore.executor.base import Steady
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.executor.wave_state import DecodeResult, PreparedView
from vecstore.kernels.reference import softcap_
from vecstore.kernels.zones import Zones


def exact_decode(self: object, prep: PreparedView, steady: Steady, q: torch.Tensor,
                 scale: float, softcap: float | None = None,
                 steady_ready: torch.cuda.Event | None = None) -> DecodeResult:
    """Exact attention of ``q [B, Hq, D]`` over the steady zone (its ``lengths``) and every
    row of the prepared view's clusters, soft-capped by ``softcap``; no unit counts as
    retrieved or estimated. CPU only: ``steady_ready`` is always ``None`` there."""
    assert steady_ready is None
    B, Hq, D = q.shape
    rows, N, _ = prep.keys.shape
    H = rows // B
    G = Hq // H
    S = steady.keys.shape[2]
    keys = torch.cat([steady.keys.reshape(rows, S, D), prep.keys.to(q.device)], dim=1)
    values = torch.cat([steady.values.reshape(rows, S, D), prep.values.to(q.device)], dim=1)
    in_steady = (torch.arange(S) < steady.lengths[:, None])[:, None].expand(B, H, S)
    in_steady = in_steady.reshape(rows, S)
    start = prep.first_row.long()
    end = start + prep.sizes.long()
    pos = torch.arange(N)
    in_view = ((pos >= start[..., None]) & (pos < end[..., None])).any(dim=1)
    valid = torch.cat([in_steady, in_view], dim=1)  # [rows, S + N]
    qf = q.reshape(rows, G, D).float()
    scores = softcap_((qf @ keys.float().transpose(1, 2)) * scale, softcap)
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ values.float()
    zones = Zones.empty(rows, prep.sizes.shape[1], prep.r_max, q.device, prep.e_max)
    for t in (zones.cum, zones.count, zones.est_count):
        t.zero_()
    return DecodeResult(out=out.reshape(B, Hq, D).to(q.dtype), lse=lse.reshape(B, Hq),
                        zones=zones, parts_lse=lse.reshape(B * Hq, 1), num_exact_parts=1)


CPU_WAVE = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
            "attention": {"sink_tokens": 2, "window_tokens": 4, "update_tokens": 8},
            "executor": {"kind": "wave", "device": "cpu"}}
"""Small segments and tails on the CPU: a few dozen decode steps index segments."""


@pytest.fixture
def exact_wave_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wave executor's fused step replaced by :func:`exact_decode`."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused path takes CPU tensors
    monkeypatch.setattr(WaveExecutor, "decode", exact_decode)
