"""Bad sequence names and store paths get clear errors and change nothing."""

from __future__ import annotations

import os
import sqlite3

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.vecstore.persistence.persist_helpers import built_copy
from vecstore import Store
from vecstore.errors import CatalogError, CorruptionError, InvalidValueError, NotFoundError

BAD_NAMES = ["../x", "..", ".", "/etc/passwd", "a/b", "a\\b", "", "x" * 129, "a\x00b",
             ".hidden", "-dash", "spa ce", "catalog.sqlite/..", None, 3]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_sequence_names_are_refused(tmp_path, name):
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(InvalidValueError, match="name: expected"):
            store.create(name, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        assert store.sequences() == []
    assert sorted(os.listdir(tmp_path / "s" / "data")) == []


@settings(max_examples=15)
@given(name=st.text(min_size=1, max_size=140))
def test_no_accepted_name_reaches_the_file_system(tmp_path_factory, name):
    """Whatever name is accepted, data lives only in random directories under data/."""
    path = tmp_path_factory.mktemp("names") / "s"
    with Store.open(path) as store:
        try:
            store.create(name, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        except InvalidValueError:
            return
    with Store.open(path, read_only=True) as store:
        assert store.sequences() == [name]
    assert {f for f in os.listdir(path) if not f.endswith(("-wal", "-shm"))} == {
        "LOCK", "catalog.sqlite", "data"}
    (d,) = os.listdir(path / "data")
    assert len(d) == 16 and int(d, 16) >= 0


@pytest.mark.parametrize("path", ["", "a\x00b", 42, b"bytes/path", "x" * 5000])
def test_bad_store_paths_are_refused(path):
    with pytest.raises(InvalidValueError, match="path: expected"):
        Store.open(path)


def test_a_foreign_directory_is_refused_and_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidValueError, match="is not a vecstore store"):
        Store.open(tmp_path)
    assert os.listdir(tmp_path) == ["notes.txt"]
    with pytest.raises(InvalidValueError, match="is a file"):
        Store.open(tmp_path / "notes.txt")
    with pytest.raises(NotFoundError, match="no store"):
        Store.open(tmp_path / "missing", read_only=True)
    with pytest.raises(NotFoundError, match="not a vecstore store"):
        Store.open(tmp_path, read_only=True)


def test_an_empty_directory_becomes_a_store(tmp_path):
    with Store.open(tmp_path) as store:
        assert store.path == tmp_path
    assert sorted(os.listdir(tmp_path)) == ["LOCK", "catalog.sqlite", "data"]


def test_other_sqlite_files_are_not_catalogs(tmp_path):
    (tmp_path / "s").mkdir()
    con = sqlite3.connect(tmp_path / "s" / "catalog.sqlite")
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    with pytest.raises(CatalogError, match="not a vecstore catalog"):
        Store.open(tmp_path / "s")
    (tmp_path / "s" / "catalog.sqlite").write_bytes(b"definitely not sqlite" * 100)
    with pytest.raises(CorruptionError, match="catalog.sqlite"):
        Store.open(tmp_path / "s", read_only=True)


def test_newer_schema_versions_are_refused(tmp_path):
    from vecstore.errors import SchemaVersionError

    built_copy(tmp_path / "s")
    con = sqlite3.connect(tmp_path / "s" / "catalog.sqlite")
    con.execute("UPDATE store SET schema_version = 99")
    con.execute("PRAGMA user_version = 99")
    con.commit()
    con.close()
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        Store.open(tmp_path / "s")


def test_catalog_paths_cannot_leave_the_store(tmp_path):
    built_copy(tmp_path / "s")
    con = sqlite3.connect(tmp_path / "s" / "catalog.sqlite")
    con.execute("UPDATE files SET path = '../../../etc/passwd' WHERE id = 1")
    con.commit()
    con.close()
    with Store.open(tmp_path / "s", read_only=True) as store:
        report = store.verify(raise_on_error=False)
        assert any("outside the store" in p for p in report.problems)
        with pytest.raises(CorruptionError, match="outside the store"):
            for name in store.sequences():
                for layer in range(2):
                    store.sequence(name).query(layer, torch.randn(2, 1, 8).half())
