"""The wave executor's Triton kernels soft-cap every zone's scores as the torch reference
does (Triton's interpreter on CPU tensors; tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreted, request_interpreter
from tests.reference import exact_attention, rel_err
from vecstore.config import StoreConfig
from vecstore.executor.base import Steady
from vecstore.executor.torch_ref import TorchExecutor
from vecstore.executor.wave_exec import WaveExecutor
from vecstore.index.base import IndexView
from vecstore.index.wave import WaveIndex

H, D, G, S = 2, 16, 2, 20

request_interpreter()  # the kernels run on CPU tensors in Triton's interpreter


def _batch(cfg: StoreConfig, seed: int, lengths=(300, 160)):
    # keys scaled up so the scores reach past the caps below
    gen = torch.Generator().manual_seed(seed)
    index = WaveIndex(cfg)
    views = [IndexView.from_segments(index.build(3.0 * torch.randn(H, n, D, generator=gen),
                                                 torch.randn(H, n, D, generator=gen), 4))
             for n in lengths]
    B = len(lengths)
    steady = Steady(3.0 * torch.randn(B, H, S, D, generator=gen),
                    torch.randn(B, H, S, D, generator=gen), torch.tensor([S, 7][:B]))
    q = torch.randn(B, H * G, 1, D, generator=gen)
    return index, IndexView.stack(views), steady, q


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
@interpreted
def test_capped_wave_decode_matches_the_reference(offload):
    # a sparse budget: steady, retrieved and estimated zones all run, each capped
    cfg = StoreConfig.from_dict({"index": {"segment_tokens": 128},
                                 "attention": {"retrieval_budget": 0.1,
                                               "estimation_budget": 1.0}})
    index, view, steady, q = _batch(cfg, seed=1)
    layer = cfg.for_layer(0)
    ex = WaveExecutor(backend="triton", score_dtype=torch.float32, simulate_offload=offload)
    for cap in (2.0, None):  # the uncapped step compiles without SOFTCAP, and differs
        ref = TorchExecutor().run(index, view, steady, q, D ** -0.5, layer, cap)
        out, lse, stats = ex.run(index, view, steady, q, D ** -0.5, layer, cap)
        assert ex.can_run(index, view, q, layer)  # the kernels ran, not the reference
        assert rel_err(out, ref[0]) < 1e-5 and rel_err(lse, ref[1]) < 1e-5
        assert abs(stats.estimated_mass - ref[2].estimated_mass) < 1e-5
        assert stats.units_estimated == ref[2].units_estimated > 0
        if cap is not None:
            capped = out
    assert rel_err(capped, out) > 0.1


@interpreted
def test_capped_wave_decode_at_full_budget_is_capped_exact_attention():
    cfg = StoreConfig.from_dict({"index": {"segment_tokens": 128},
                                 "attention": {"retrieval_budget": 1.0}})
    index, view, steady, q = _batch(cfg, seed=2, lengths=(300,))
    out, lse, stats = WaveExecutor(backend="triton").run(index, view, steady, q, D ** -0.5,
                                                         cfg.for_layer(0), 1.5)
    keys = torch.cat([steady.keys[0], view.keys[0]], dim=1)
    values = torch.cat([steady.values[0], view.values[0]], dim=1)
    ref_out, ref_lse = exact_attention(q[0], keys, values, softcap=1.5)
    assert rel_err(out[0], ref_out) < 1e-5 and rel_err(lse[0], ref_lse) < 1e-5
    assert stats.tokens_exact == stats.tokens_total == S + 300
