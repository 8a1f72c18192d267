"""Every misuse raises the right vecstore error, naming the problem, and changes nothing."""

from __future__ import annotations

import pickle

import pytest
import torch

from vecstore import Store, errors
from vecstore.errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidValueError,
    NotFoundError,
    SequenceDroppedError,
    ShapeError,
    StoreClosedError,
)


@pytest.fixture
def seq(mem_store):
    s = mem_store.create("s", num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    s.append(0, torch.randn(2, 10, 8), torch.randn(2, 10, 8))
    return s


def _unchanged(seq) -> tuple:
    return tuple(layer.num_tokens for layer in seq.layers)


@pytest.mark.parametrize("keys,values,match,err", [
    (torch.randn(3, 4, 8), torch.randn(3, 4, 8), r"keys: expected shape \(2, \*, 8\)", ShapeError),
    (torch.randn(2, 4, 7), torch.randn(2, 4, 7), "keys: expected shape", ShapeError),
    (torch.randn(2, 4, 8), torch.randn(2, 5, 8), r"values: expected shape \(2, 4, 8\)",
     ShapeError),
    (torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, 8), "keys: expected dtype",
     ShapeError),
    (torch.randn(2, 0, 8), torch.randn(2, 0, 8), "at least one token", ShapeError),
    (torch.full((2, 4, 8), float("nan")), torch.randn(2, 4, 8), "keys: contains 64 NaN/Inf",
     InvalidValueError),
    (torch.randn(2, 4, 8), torch.full((2, 4, 8), float("inf")), "values: contains",
     InvalidValueError),
    ([[1.0]], torch.randn(2, 4, 8), "keys: expected a torch.Tensor", ShapeError),
])
def test_bad_appends(seq, keys, values, match, err):
    before = _unchanged(seq)
    with pytest.raises(err, match=match):
        seq.append(0, keys, values)
    assert _unchanged(seq) == before


@pytest.mark.parametrize("layer", [-1, 2, 1.0, "0", True])
def test_bad_layer_indices(seq, layer):
    with pytest.raises(InvalidValueError, match="layer"):
        seq.append(layer, torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    with pytest.raises(InvalidValueError, match="layer"):
        seq.query(layer, torch.randn(4, 1, 8))


@pytest.mark.parametrize("q,match,err", [
    (torch.randn(3, 1, 8), "multiple of the 2 KV heads", ShapeError),
    (torch.randn(4, 1, 6), r"q: expected shape", ShapeError),
    (torch.randn(4, 8), r"q: expected shape \(Hq, L, D\)", ShapeError),
    (torch.randn(4, 0, 8), "L >= 1", ShapeError),
    (torch.randn(4, 1, 8).half(), "q: expected dtype", ShapeError),
    (torch.full((4, 1, 8), float("nan")), "q: contains", InvalidValueError),
])
def test_bad_queries(seq, q, match, err):
    with pytest.raises(err, match=match):
        seq.query(0, q)


def test_query_of_an_empty_layer(seq):
    with pytest.raises(InvalidValueError, match="layer 1 of sequence 's' holds no tokens"):
        seq.query(1, torch.randn(4, 1, 8))


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), "x"])
def test_bad_scale(seq, scale):
    with pytest.raises(InvalidValueError, match="scale"):
        seq.query(0, torch.randn(4, 1, 8), scale=scale)


@pytest.mark.parametrize("k", [0, -2, 1.5, True])
def test_bad_search_k(seq, k):
    with pytest.raises(InvalidValueError, match="k: expected a positive integer"):
        seq.search(0, torch.randn(4, 1, 8), k)


@pytest.mark.parametrize("name", ["", "../x", "/abs", "a/b", "x\x00y", "a" * 129, ".", "..",
                                  ".hidden", 5, None])
def test_bad_names(mem_store, name):
    with pytest.raises(InvalidValueError, match="name"):
        mem_store.create(name, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    assert mem_store.sequences() == []


@pytest.mark.parametrize("kwargs,match", [
    ({"num_layers": 0}, "num_layers"), ({"num_kv_heads": -1}, "num_kv_heads"),
    ({"head_dim": 2.0}, "head_dim"), ({"dtype": "int8"}, "dtype"),
    ({"dtype": torch.int32}, "dtype"),
])
def test_bad_create_arguments(mem_store, kwargs, match):
    args = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", **kwargs}
    with pytest.raises(InvalidValueError, match=match):
        mem_store.create("x", **args)


def test_unknown_and_duplicate_names(mem_store, seq):
    with pytest.raises(AlreadyExistsError, match="'s' already exists"):
        mem_store.create("s", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    with pytest.raises(NotFoundError, match="no sequence 'nope'"):
        mem_store.sequence("nope")
    with pytest.raises(NotFoundError):
        mem_store.drop("nope")
    with pytest.raises(ConfigError, match="unknown index 'waev'.*did you mean 'wave'"):
        Store.open(config={"index": {"kind": "waev"}})


def test_dropped_sequence_refuses_work(mem_store, seq):
    mem_store.drop("s")
    assert mem_store.sequences() == []
    with pytest.raises(SequenceDroppedError, match="'s' was dropped"):
        seq.append(0, torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    with pytest.raises(SequenceDroppedError):
        seq.query(0, torch.randn(4, 1, 8))


def test_closed_store_refuses_work():
    store = Store.open()
    seq = store.create("s", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    store.close()
    store.close()  # twice is fine
    with pytest.raises(StoreClosedError):
        seq.append(0, torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    with pytest.raises(StoreClosedError):
        store.sequences()


def test_batched_query_rejects_mixed_sequences(mem_store, seq):
    other = mem_store.create("o", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
    other.append(0, torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(InvalidValueError, match="differ in KV heads"):
        mem_store.query([seq, other], 0, torch.randn(2, 4, 1, 8))
    with pytest.raises(InvalidValueError, match="non-empty list"):
        mem_store.query([], 0, torch.randn(0, 4, 1, 8))
    with pytest.raises(ShapeError, match=r"q: expected shape \(1, \*, \*, 8\)"):
        mem_store.query([seq], 0, torch.randn(2, 4, 1, 8))


@pytest.mark.parametrize("name", errors.__all__)
def test_errors_pickle_and_share_one_root(name):
    cls = getattr(errors, name)
    err = pickle.loads(pickle.dumps(cls("message")))
    assert isinstance(err, errors.VecstoreError) and str(err) == "message"
