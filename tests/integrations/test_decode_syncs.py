"""The wave cache's decode step does not wait for the device: one host sync per layer (the
NaN/Inf scan of the step's q, k and v), and its stats stay on the device until read.

The fused kernels are replaced by a stand-in of the same output shapes, so the whole host
side of the fused path runs on CPU tensors without Triton; a host sync is any call that
reads device data back (counted by :class:`tests.syncs.HostSyncs`).
"""

from __future__ import annotations

import pytest
import torch

from integrations.hf import WaveCache
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import SMALL, tiny_model
from tests.syncs import HostSyncs
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.executor.wave_state import DecodeResult
from vecstore.kernels.zones import Zones

WAVE = {**SMALL, "executor": {"kind": "wave", "device": "cpu"}}


def _stand_in(self, prep, steady, q, scale, softcap=None):
    B, Hq, D = q.shape
    rows, C = prep.sizes.shape
    zones = Zones.empty(rows, C, prep.r_max, q.device, prep.e_max)
    for t in (zones.cum, zones.count, zones.est_count):
        t.fill_(1)
    return DecodeResult(out=torch.zeros_like(q), lse=torch.zeros(B, Hq),
                        zones=zones, parts_lse=torch.zeros(B * Hq, 3), num_exact_parts=2)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_syncs_once_per_layer(monkeypatch, batch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused path accepts CPU tensors
    monkeypatch.setattr(WaveExecutor, "decode", _stand_in)
    model = tiny_model("llama", 4, 2)
    ids = torch.randint(3, 96, (batch, 200), generator=torch.Generator().manual_seed(0))
    kw = cache_kwarg(model)
    with WaveCache(WAVE, model) as cache, torch.no_grad():
        cache.store.executor.backend = "triton"
        model(ids, use_cache=True, **{kw: cache})
        nxt = ids[:, -1:]
        model(nxt, use_cache=True, **{kw: cache})  # prepares each layer's view (once)
        _ = cache.decode_stats
        with HostSyncs() as syncs:
            model(nxt, use_cache=True, **{kw: cache})
        layers = model.config.num_hidden_layers
        assert syncs.total == layers, dict(syncs.count)
        pending = list(cache._attention._pending)
        assert len(pending) == layers and not any(s.is_materialized for s in pending)
        stats = cache.decode_stats  # read back now
        assert all(s.is_materialized for s in pending)
        assert stats.queries == 2 * layers
        assert [s.tokens_total for s in pending] == [batch * 202] * layers
