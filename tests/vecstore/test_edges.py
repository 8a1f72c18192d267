"""Inputs at the edges of the API: every bad one a typed error naming it that changes
nothing, every good one accepted."""

from __future__ import annotations

import pytest
import torch

from vecstore import Store
from vecstore.config import (
    AttentionConfig,
    CacheConfig,
    ExecutorConfig,
    IndexConfig,
    LayerOverride,
    StoreConfig,
)
from vecstore.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidValueError,
    SequenceDroppedError,
    ShapeError,
)

CUDA = torch.cuda.is_available()


@pytest.fixture
def seq(mem_store):
    s = mem_store.create("s", num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    s.append(0, torch.randn(2, 10, 8), torch.randn(2, 10, 8))
    return s


def _state(store: Store) -> tuple:
    q = torch.ones(4, 1, 8)
    return tuple((n, tuple(store.sequence(n).tokens(i) for i in range(2)),
                  tuple(store.sequence(n).query(0, q).out.flatten().tolist()))
                 for n in store.sequences())


@pytest.mark.parametrize("build,match", [
    (lambda: IndexConfig(tokens_per_cluster="16"), r"index\.tokens_per_cluster: expected an int"),
    (lambda: IndexConfig(kind=3), r"index\.kind: expected a string"),
    (lambda: AttentionConfig(retrieval_budget=None), r"attention\.retrieval_budget"),
    (lambda: CacheConfig(capacity=True), r"cache\.capacity: expected a number"),
    (lambda: ExecutorConfig(device=None), r"executor\.device: expected a string"),
    (lambda: ExecutorConfig(device="cuda:abc"), r"executor\.device: must be 'cpu', 'cuda'"),
    (lambda: ExecutorConfig(device="cudax"), r"executor\.device"),
    (lambda: LayerOverride(exact="yes"), r"layers\.\*\.exact: expected true/false"),
    (lambda: StoreConfig(index={"kind": "wave"}), r"index: expected an instance of IndexConfig"),
    (lambda: StoreConfig(layers={0: {"exact": True}}), r"layers\.0: expected a LayerOverride"),
    (lambda: StoreConfig(layers={True: LayerOverride()}), r"layers\.True: layer keys"),
])
def test_config_dataclasses_built_directly_are_checked(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_valid_configs_built_directly_are_accepted():
    cfg = StoreConfig(index=IndexConfig(radius_weight=1), executor=ExecutorConfig(device="cuda:1"),
                      layers={3: LayerOverride(exact=True)})
    assert cfg.index.radius_weight == 1.0 and isinstance(cfg.index.radius_weight, float)
    assert StoreConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("device,err", [
    ("bogus", InvalidValueError), (123, InvalidValueError), ("mps", InvalidValueError),
    ("meta", InvalidValueError), ("cuda:-1", InvalidValueError), (None, None),
    pytest.param("cuda", BackendUnavailableError, marks=pytest.mark.skipif(CUDA, reason="cpu")),
    pytest.param("cuda:99", BackendUnavailableError),
])
def test_devices_of_create(mem_store, seq, device, err):
    before = _state(mem_store)
    if err is None:  # None: the executor's device
        assert mem_store.create("ok", num_layers=1, num_kv_heads=1, head_dim=4,
                                dtype="float32", device=device).device.type == "cpu"
        return
    with pytest.raises(err, match="device"):
        mem_store.create("x", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                         device=device)
    assert _state(mem_store) == before


@pytest.mark.parametrize("devices,err", [
    (["cuda:99", "cpu"], BackendUnavailableError), (["bogus", "cpu"], InvalidValueError),
    ([0, "cpu"], InvalidValueError), (["cpu"], InvalidValueError),
])
def test_devices_of_place(mem_store, seq, devices, err):
    before = _state(mem_store)
    with pytest.raises(err, match="devices"):
        seq.place(devices)
    assert _state(mem_store) == before and seq.layer_devices == [torch.device("cpu")] * 2
    seq.place([torch.device("cpu"), "cpu:0"])  # valid forms


@pytest.mark.parametrize("arg", ["num_layers", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [4097, 2 ** 62, 2 ** 64])
def test_sizes_are_bounded(mem_store, arg, value):
    args = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, arg: value}
    with pytest.raises(InvalidValueError, match=f"{arg}: expected at most 4096"):
        mem_store.create("x", dtype="float32", **args)
    assert mem_store.sequences() == []
    mem_store.create("y", dtype="float32", **{**args, arg: 4096 if arg != "num_layers" else 8})


def test_search_k_is_bounded_by_the_layer(seq):
    with pytest.raises(InvalidValueError, match="k: expected at most 10"):
        seq.search(0, torch.randn(4, 1, 8), 2 ** 40)
    assert seq.search(0, torch.randn(4, 1, 8), 10).ids.shape == (2, 10)


def test_meta_tensors_are_refused(mem_store, seq):
    before = _state(mem_store)
    meta = torch.empty(2, 3, 8, device="meta")
    with pytest.raises(ShapeError, match="keys: is on the meta device"):
        seq.append(0, meta, meta)
    with pytest.raises(ShapeError, match="keys: is on the meta device"):
        mem_store.append_batch([seq], 0, meta[None], meta[None])
    with pytest.raises(ShapeError, match="q: is on the meta device"):
        seq.query(0, torch.empty(4, 1, 8, device="meta"))
    with pytest.raises(ShapeError, match="q: is on the meta device"):
        seq.search(0, torch.empty(4, 1, 8, device="meta"), 1)
    assert _state(mem_store) == before


@pytest.mark.parametrize("call", ["view", "steady"])
@pytest.mark.parametrize("layer", [5, -1, 2, "0", 1.0])
def test_layer_indices_of_view_and_steady(seq, call, layer):
    with pytest.raises(InvalidValueError, match="layer"):
        getattr(seq, call)(layer)


@pytest.mark.parametrize("name", ["a\n", "a\nb", "\na", "a\r", "a\t", "é"])
def test_names_with_control_or_other_characters(mem_store, name):
    with pytest.raises(InvalidValueError, match="name: expected"):
        mem_store.create(name, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    assert mem_store.sequences() == []


def test_a_dropped_sequence_answers_nothing(mem_store, seq):
    seq.view(0), seq.steady(0)  # loaded before the drop
    mem_store.drop("s")
    for call in (lambda: seq.tokens(0), lambda: seq.num_tokens, lambda: seq.steady(0),
                 lambda: seq.view(0), lambda: seq.search(0, torch.randn(4, 1, 8), 1),
                 lambda: seq.place(["cpu", "cpu"])):
        with pytest.raises(SequenceDroppedError, match="'s' was dropped"):
            call()
    assert "dropped" in repr(seq)
