"""Per-layer placement: each layer's state lives on, and is queried on, its own device."""

from __future__ import annotations

import pytest
import torch

from tests.reference import exact_attention, rel_err
from vecstore import Store
from vecstore.errors import InvalidValueError

CFG = {"index": {"tokens_per_cluster": 4, "segment_tokens": 64},
       "attention": {"sink_tokens": 2, "window_tokens": 4, "update_tokens": 8,
                     "retrieval_budget": 1.0}}


def test_each_layer_state_follows_its_device():
    with Store.open(config=CFG) as store:
        seq = store.create("s", num_layers=3, num_kv_heads=1, head_dim=4, dtype="float32")
        for layer in range(3):
            seq.append(layer, torch.randn(1, 40, 4), torch.randn(1, 40, 4))
        seq.place(["cpu", "meta", "cpu"])
        state = seq.layers[1]
        tensors = [state.sink_keys, state.pending_values,
                   *[t for s in state.segments for t in (s.keys, s.values, s.offsets,
                                                          *s.meta.values())]]
        assert all(t.device.type == "meta" for t in tensors)
        assert seq.layers[0].sink_keys.device.type == "cpu"
        seq.append(1, torch.randn(1, 1, 4), torch.randn(1, 1, 4))  # moved to the layer
        assert seq.layers[1].pending_keys.device.type == "meta"
        assert seq.layer_devices == [torch.device("cpu"), torch.device("meta"),
                                     torch.device("cpu")]


def test_queries_run_on_the_layer_device_and_stay_exact():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 50, 8, generator=gen), torch.randn(2, 50, 8, generator=gen)
    q = torch.randn(4, 1, 8, generator=gen)
    with Store.open(config=CFG) as store:
        seq = store.create("s", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
        for layer in range(2):
            seq.append(layer, keys, values)
        seq.place(["meta", "cpu"])
        res = seq.query(1, q)
        assert rel_err(res.out, exact_attention(q, keys, values)[0]) < 1e-5
        assert seq.search(1, q, 3).ids.device.type == "cpu"


@pytest.mark.parametrize("devices", [["cpu"], "cpu", ["cpu", "nope"]])
def test_bad_placements_are_refused(devices):
    with Store.open() as store:
        seq = store.create("s", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")
        with pytest.raises(InvalidValueError, match="devices"):
            seq.place(devices)
        assert seq.layer_devices == [torch.device("cpu")] * 2
