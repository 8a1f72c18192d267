"""Transactions, config compatibility, read-only stores and the writer lock."""

from __future__ import annotations

import pytest
import torch

from tests.vecstore.persistence.persist_helpers import (
    DIM,
    HEADS,
    LAYERS,
    answers,
    built_copy,
    config,
    expected_rows,
    stored_rows,
    stream,
)
from vecstore import Store
from vecstore.errors import (
    IncompatibleError,
    InvalidValueError,
    LockedError,
    ReadOnlyError,
    StoreClosedError,
)


def _create(store: Store, name: str = "a"):
    return store.create(name, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                        dtype=torch.float16)


def _step(seq, at: int, n: int, seed: int = 1) -> None:
    for layer in range(seq.num_layers):
        k, v = stream(seed, layer, at + n)
        seq.append(layer, k[:, at:], v[:, at:])


def test_transaction_commits_all_layers_at_once(tmp_path):
    with Store.open(tmp_path / "s", config()) as store:
        with store.transaction():
            seq = _create(store)
            _step(seq, 0, 100)
            with store.transaction():  # nested blocks join the outer one
                _step(seq, 100, 1)
            with Store.open(tmp_path / "s", read_only=True) as reader:
                assert reader.sequences() == []  # nothing committed inside the block
        with Store.open(tmp_path / "s", read_only=True) as reader:
            assert reader.sequence("a").num_tokens == 101
            assert torch.equal(stored_rows(reader.sequence("a"), 1), expected_rows(1, 1, 101))


def test_failed_transaction_is_undone_in_memory_and_on_disk(tmp_path):
    with Store.open(tmp_path / "s", config()) as store:
        seq = _create(store)
        _step(seq, 0, 50)
        before = answers(seq)
        with pytest.raises(RuntimeError, match="boom"), store.transaction():
            _step(seq, 50, 30)
            store.drop("a")
            _create(store, "b")
            raise RuntimeError("boom")
        assert store.sequences() == ["a"] and not seq.is_dropped
        assert seq.num_tokens == 50
        after = answers(seq)
        assert all(torch.equal(x[0], y[0]) for x, y in zip(before, after, strict=True))
        _step(seq, 50, 30)  # the sequence still works after the rollback
    with Store.open(tmp_path / "s", read_only=True) as store:
        assert store.sequences() == ["a"]
        assert torch.equal(stored_rows(store.sequence("a"), 0), expected_rows(1, 0, 80))
        assert store.verify().ok


def test_drop_and_recreate_in_one_transaction(tmp_path):
    built_copy(tmp_path / "s")
    with Store.open(tmp_path / "s") as store, store.transaction():
        store.drop("a")
        _step(_create(store, "a"), 0, 10, seed=5)
    with Store.open(tmp_path / "s", read_only=True) as store:
        assert store.sequence("a").num_tokens == 10
        assert torch.equal(stored_rows(store.sequence("a"), 0), expected_rows(5, 0, 10))
        assert store.verify().ok


def test_closing_inside_a_transaction_discards_it(tmp_path):
    store = Store.open(tmp_path / "s", config())
    with pytest.raises(StoreClosedError), store.transaction():
        _create(store)
        store.close()
    with Store.open(tmp_path / "s", read_only=True) as reader:
        assert reader.sequences() == []


def test_conflicting_config_names_both_values(tmp_path):
    built_copy(tmp_path / "s")
    bad = {**config(), "index": {**config()["index"], "tokens_per_cluster": 8}}
    with pytest.raises(IncompatibleError, match=r"tokens_per_cluster \(stored 4, given 8\)"):
        Store.open(tmp_path / "s", bad)
    with Store.open(tmp_path / "s") as store:  # the failed open left no lock behind
        assert store.config.index.tokens_per_cluster == 4


def test_compatible_settings_may_change_per_open(tmp_path):
    built_copy(tmp_path / "s")
    wider = {**config(), "attention": {**config()["attention"], "retrieval_budget": 1.0,
                                       "window_tokens": 9}, "cache": {"policy": "fifo"}}
    with Store.open(tmp_path / "s", wider) as store:
        assert store.config.attention.retrieval_budget == 1.0
        res = store.sequence("a").query(0, torch.randn(4, 1, DIM).half())
        assert res.stats.tokens_exact == res.stats.tokens_total
    with Store.open(tmp_path / "s") as store:  # the stored settings did not change
        assert store.config.attention.retrieval_budget == 0.3


def test_exact_layer_override_must_match_built_segments(tmp_path):
    built_copy(tmp_path / "s")
    exact = {**config(), "layers": {"1": {"exact": True}}}
    with pytest.raises(IncompatibleError, match=r"layer 1 was indexed with 'wave' \(stored\)"):
        Store.open(tmp_path / "s", exact)


def test_read_only_store_refuses_every_write(tmp_path):
    built_copy(tmp_path / "s")
    with Store.open(tmp_path / "s", read_only=True) as store:
        seq = store.sequence("a")
        k, v = stream(1, 0, 1)
        for write in (lambda: seq.append(0, k, v), lambda: _create(store, "c"),
                      lambda: store.drop("a"), store.gc):
            with pytest.raises(ReadOnlyError):
                write()
        assert store.is_read_only and seq.num_tokens == 205
    with pytest.raises(InvalidValueError, match="read_only"):
        Store.open(read_only=True)


def test_one_writer_at_a_time_readers_alongside(tmp_path):
    writer = Store.open(tmp_path / "s", config())
    try:
        with pytest.raises(LockedError, match="already open for writing"):
            Store.open(tmp_path / "s")
        _step(_create(writer), 0, 20)
        with Store.open(tmp_path / "s", read_only=True) as reader:
            assert reader.sequence("a").num_tokens == 20
    finally:
        writer.close()
        writer.close()  # twice is fine
    with Store.open(tmp_path / "s") as store:  # the lock went with the writer
        assert store.sequences() == ["a"]


def test_in_memory_stores_have_no_files(tmp_path):
    with Store.open() as store:
        for call in (store.info, store.verify, store.gc):
            with pytest.raises(InvalidValueError, match="in-memory"):
                call()
        with pytest.raises(RuntimeError), store.transaction():  # rollback works in memory too
            _step(_create(store), 0, 5)
            raise RuntimeError
        assert store.sequences() == []
