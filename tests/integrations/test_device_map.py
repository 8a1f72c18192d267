"""Models spread over several devices: each layer's store state follows its layer's device.

The CPU stands in for one GPU and ``meta`` for another (a two-"device" map): no data
moves on ``meta``, but placement is checked on every tensor a layer holds.
"""

from __future__ import annotations

import torch

from integrations.hf import WaveCache
from integrations.hf.cache import cache_kwarg
from integrations.hf.install import model_shape
from tests.integrations.hf_models import SMALL, tiny_model
from vecstore import Store


def _layer_tensors(state) -> list[torch.Tensor]:
    return [state.sink_keys, state.sink_values, state.pending_keys, state.pending_values,
            *[t for s in state.segments for t in (s.keys, s.values, s.offsets,
                                                   *s.meta.values())]]


def test_model_shape_reports_each_layers_device():
    model = tiny_model("llama", 4, 2, layers=3)
    assert model_shape(model).layer_devices == (torch.device("cpu"),) * 3
    model.model.layers[2].to("meta")
    assert [d.type for d in model_shape(model).layer_devices] == ["cpu", "cpu", "meta"]


def test_reused_sequence_is_placed_on_each_layers_device():
    model = tiny_model("llama", 4, 2, layers=2)
    # a prompt longer than one index segment (64) past the sinks and the window
    ids = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(0))
    with Store.open(config=SMALL) as store:
        with WaveCache(store, model, name="doc") as cache, torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        seq = store.sequence("doc")
        assert seq.layers[1].segments, "the prompt should have been indexed"
        model.model.layers[1].to("meta")  # layer 1 now "runs" on another device
        with WaveCache.from_store(store, "doc", model):
            assert all(t.device.type == "cpu" for t in _layer_tensors(seq.layers[0]))
            assert all(t.device.type == "meta" for t in _layer_tensors(seq.layers[1]))
        assert [d.type for d in seq.layer_devices] == ["cpu", "meta"]
