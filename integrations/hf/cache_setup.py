"""What a :class:`~integrations.hf.cache.WaveCache` derives from its model when it opens:
the configuration of the store it opens, the sequences of a batch and where their layers
live, and whether its decode steps run as fixed-shape (graphed) steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from integrations.hf.install import ModelShape
from vecstore import Sequence, Store, StoreConfig
from vecstore.config import load_config
from vecstore.errors import InvalidValueError

__all__ = ["create_rows", "decode_graphs", "place_rows", "store_config"]


def store_config(config: StoreConfig | Mapping[str, Any] | str | Path | None,
                 shape: ModelShape) -> StoreConfig:
    """The configuration of a store a cache opens for a model: ``config`` as given, or the
    defaults on the model's CUDA device."""
    cfg = load_config(config)
    if config is None and shape.device.type == "cuda":
        cfg = dataclasses.replace(cfg, executor=dataclasses.replace(
            cfg.executor, device=str(shape.device)))
    return cfg


def place_rows(seq: Sequence, shape: ModelShape) -> None:
    """Keep each layer's state on the device its model layer runs on, so a model spread
    over several GPUs never copies KV across devices during decode."""
    devices = [shape.layer_devices[layer] for layer in shape.store_layers]
    if len(set(devices)) > 1:
        seq.place(devices)


def create_rows(store: Store, name: str, batch: int, shape: ModelShape,
                fingerprint: str) -> list[Sequence]:
    """The sequences of a batch of ``batch`` rows (``name``, or ``name.<b>`` for several),
    shaped for the model's stored layers and placed as its layers are."""
    names = [name] if batch == 1 else [f"{name}.{b}" for b in range(batch)]
    seqs = [store.create(n, num_layers=len(shape.store_layers), num_kv_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, dtype=shape.dtype, fingerprint=fingerprint)
            for n in names]
    for seq in seqs:
        place_rows(seq, shape)
    return seqs


def decode_graphs(cuda_graphs: bool | None, compile_layers: bool, device: torch.device) -> bool:
    """Whether decode steps run as fixed-shape steps (``None``: on a CUDA device); compiled
    layers need them."""
    graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
    if compile_layers and not graphs:
        raise InvalidValueError("compile_layers: compiled layers serve the fixed-shape decode "
                                "steps; pass cuda_graphs=True too")
    return graphs
