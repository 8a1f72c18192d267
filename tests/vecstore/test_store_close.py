"""A closed store lets go of its sequences: their KV goes with the caller's last reference."""

from __future__ import annotations

import gc
import weakref

import torch

from vecstore import Store


def test_closed_store_keeps_no_sequence_alive():
    gc.disable()  # nothing may depend on the cycle collector running
    try:
        with Store.open(config={"index": {"kind": "wave"}}) as store:
            seq = store.create("s", num_layers=2, num_kv_heads=2, head_dim=16,
                               dtype=torch.float32)
            for layer in range(2):
                seq.append(layer, torch.randn(2, 3000, 16), torch.randn(2, 3000, 16))
            store.query([seq], 0, torch.randn(1, 4, 1, 16), scale=0.25)
        assert seq.layers[0].num_tokens == 3000  # still readable after the close
        alive = weakref.ref(seq)
        del seq
        assert alive() is None
    finally:
        gc.enable()
