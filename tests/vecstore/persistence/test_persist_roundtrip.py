"""Build, close, reopen, query: identical outputs, and what info and verify report."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.vecstore.persistence.persist_helpers import (
    DIM,
    HEADS,
    LAYERS,
    answers,
    build,
    built_copy,
    config,
    expected_rows,
    fill,
    queries,
    stored_rows,
    stream,
)
from vecstore import Store
from vecstore.index import INDEXES


def _same(a: list, b: list) -> None:
    for (out_a, lse_a, stats_a), (out_b, lse_b, stats_b) in zip(a, b, strict=True):
        assert torch.equal(out_a, out_b)
        assert torch.equal(lse_a, lse_b)
        assert stats_a == stats_b


@pytest.mark.parametrize("kind", INDEXES.names())
def test_reopened_store_answers_bit_for_bit(tmp_path, kind):
    before = build(tmp_path / "s", kind)
    for read_only in (False, True):
        with Store.open(tmp_path / "s", read_only=read_only) as store:
            seq = store.sequence("a")
            assert not seq.layers[0].is_loaded  # lazy: nothing read yet
            assert seq.num_tokens == 205 and seq.fingerprint == "model-x"
            _same(before, answers(seq))
            assert seq.layers[0].is_loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_token_survives_in_every_dtype(tmp_path, dtype):
    before = build(tmp_path / "s", dtype=dtype)
    with Store.open(tmp_path / "s", read_only=True) as store:
        seq = store.sequence("a")
        assert seq.dtype == dtype
        for layer in range(LAYERS):
            assert torch.equal(stored_rows(seq, layer), expected_rows(1, layer, 205, dtype))
        _same(before, answers(seq))
        r = seq.search(0, queries(seq), 3)
        assert (r.ids >= 0).all()


def test_appends_after_reopen_match_a_store_never_closed(tmp_path):
    chunks = [150, 1, 1, 9, 40, 1, 3, 30, 2]
    with Store.open(tmp_path / "ref", config()) as store:
        ref = store.create("a", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                           dtype=torch.float16)
        fill(ref, 1, chunks)
        want = answers(ref)
    with Store.open(tmp_path / "s", config()) as store:
        seq = store.create("a", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                           dtype=torch.float16)
        fill(seq, 1, chunks[:4])
    at = sum(chunks[:4])
    for n in chunks[4:]:
        with Store.open(tmp_path / "s") as store:
            seq = store.sequence("a")
            for layer in range(LAYERS):
                k, v = stream(1, layer, at + n)
                seq.append(layer, k[:, at:at + n], v[:, at:at + n])
        at += n
    with Store.open(tmp_path / "s") as store:
        _same(want, answers(store.sequence("a")))
        assert store.verify().ok


def test_info_and_verify_report_what_was_stored(tmp_path):
    built_copy(tmp_path / "s")
    with Store.open(tmp_path / "s", read_only=True) as store:
        info = store.info()
        report = store.verify()
        seq = store.sequence("a")
        segments = sum(len(seq.layers[i].segments) for i in range(LAYERS))
        clusters = sum(HEADS * s.num_units for i in range(LAYERS) for s in seq.layers[i].segments)
    a, b = info.sequences
    assert (a.name, a.num_tokens, a.num_layers, a.dtype, a.fingerprint) == (
        "a", 205, LAYERS, "float16", "model-x")
    assert a.num_segments == segments and a.num_clusters == clusters
    assert a.raw_kv_bytes == 205 * LAYERS * 2 * HEADS * DIM * 2
    assert info.raw_kv_bytes == a.raw_kv_bytes + b.raw_kv_bytes
    assert info.disk_bytes >= a.data_bytes + b.data_bytes + info.catalog_bytes > 0
    assert info.config["index"]["tokens_per_cluster"] == 4
    assert "a" in info.summary() and info.to_dict()["sequences"][0]["name"] == "a"
    assert report.ok and not report.unreferenced
    assert report.files_checked == report.segments == a.num_segments + b.num_segments
    assert report.clusters == a.num_clusters + b.num_clusters
    assert report.summary().startswith("ok: ")


def test_drop_removes_rows_and_files(tmp_path):
    built_copy(tmp_path / "s")
    with Store.open(tmp_path / "s") as store:
        store.drop("a")
        assert store.sequences() == ["b"]
    with Store.open(tmp_path / "s") as store:
        assert store.sequences() == ["b"]
        info = store.info()
        assert [q.name for q in info.sequences] == ["b"]
        assert store.verify().unreferenced == []
        assert len(list((tmp_path / "s" / "data").iterdir())) == 1


@settings(max_examples=12)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "create", "drop", "reopen"]),
                              st.integers(0, 2), st.integers(1, 40)), min_size=1, max_size=12))
def test_catalog_survives_create_close_reopen_verify(tmp_path_factory, ops):
    """Any sequence of creations, appends, drops and reopenings leaves a store that
    verifies and holds exactly the tokens appended."""
    path = tmp_path_factory.mktemp("prop") / "s"
    held: dict[str, int] = {}
    store = Store.open(path, config())
    try:
        for op, who, n in ops:
            name = f"q{who}"
            if op == "reopen":
                store.close()
                store = Store.open(path)
            elif op == "create" and name not in held:
                store.create(name, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                             dtype=torch.float16)
                held[name] = 0
            elif op == "drop" and name in held:
                store.drop(name)
                del held[name]
            elif op == "append" and name in held:
                seq = store.sequence(name)
                for layer in range(LAYERS):
                    k, v = stream(who, layer, held[name] + n)
                    seq.append(layer, k[:, held[name]:], v[:, held[name]:])
                held[name] += n
        store.close()
        store = Store.open(path, read_only=True)
        assert store.verify().ok
        assert store.sequences() == sorted(held)
        for name, n in held.items():
            seq = store.sequence(name)
            assert seq.num_tokens == n
            for layer in range(LAYERS if n else 0):
                assert torch.equal(stored_rows(seq, layer),
                                   expected_rows(int(name[1:]), layer, n))
    finally:
        store.close()
