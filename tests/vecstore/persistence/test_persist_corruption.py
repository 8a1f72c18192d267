"""Flipped bytes and truncation in data files or the catalog raise CorruptionError
naming the file, from both query and verify."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest
import torch

from tests.vecstore.persistence.persist_helpers import built_copy, stream
from vecstore import Store
from vecstore.errors import CorruptionError


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def _file_of(store_path: Path, name: str = "a") -> Path:
    con = sqlite3.connect(store_path / "catalog.sqlite")
    (rel,) = con.execute("SELECT f.path FROM files f JOIN sequences s ON f.sequence_id = s.id "
                         "WHERE s.name = ? ORDER BY f.path LIMIT 1", (name,)).fetchone()
    con.close()
    return store_path / rel


DAMAGE = {
    "flip header": lambda p: _flip(p, 12),
    "flip middle": lambda p: _flip(p, p.stat().st_size // 2),
    "flip last byte": lambda p: _flip(p, p.stat().st_size - 1),
    "truncate half": lambda p: os.truncate(p, p.stat().st_size // 2),
    "truncate one byte": lambda p: os.truncate(p, p.stat().st_size - 1),
    "empty": lambda p: os.truncate(p, 0),
    "missing": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_data_file_is_named_by_query_and_verify(tmp_path, damage):
    path = tmp_path / "s"
    built_copy(path)
    bad = _file_of(path)
    DAMAGE[damage](bad)
    named = re.escape(str(bad))
    q = torch.randn(4, 1, 8).half()
    with Store.open(path, read_only=True) as store:
        seq = store.sequence("a")
        with pytest.raises(CorruptionError, match=named):
            seq.query(0, q)
        with pytest.raises(CorruptionError, match=named):
            seq.query(0, q)  # a failed load is not cached as an empty layer
        seq.query(1, q)  # the other layer is intact
        with pytest.raises(CorruptionError, match=named):
            store.verify()
        problems = store.verify(raise_on_error=False).problems
        assert len(problems) == 1 and str(bad) in problems[0]
    with Store.open(path) as store:  # a writer cannot append onto it either
        k, v = stream(1, 0, 1)
        with pytest.raises(CorruptionError, match=named):
            store.sequence("a").append(0, k, v)
        assert store.sequence("a").tokens(0) == 205


def test_flipped_steady_chunk_in_the_catalog_is_named(tmp_path):
    path = tmp_path / "s"
    built_copy(path)
    con = sqlite3.connect(path / "catalog.sqlite")
    (blob,) = con.execute("SELECT c.keys FROM steady_chunks c JOIN layers l ON c.layer_id = l.id "
                          "JOIN sequences s ON l.sequence_id = s.id WHERE s.name = 'a' "
                          "AND l.layer = 1 AND c.zone = 'tail' ORDER BY c.id LIMIT 1").fetchone()
    con.close()
    catalog = path / "catalog.sqlite"
    at = catalog.read_bytes().find(blob)
    assert at > 0
    _flip(catalog, at + len(blob) // 2)
    named = re.escape(str(catalog))
    with Store.open(path, read_only=True) as store:
        seq = store.sequence("a")
        seq.query(0, torch.randn(4, 1, 8).half())
        with pytest.raises(CorruptionError, match=named + ".*layer 1.*checksum"):
            seq.query(1, torch.randn(4, 1, 8).half())
        with pytest.raises(CorruptionError, match=named):
            store.verify()


CATALOG_DAMAGE = {
    "flip magic": lambda p: _flip(p, 3),
    "flip page size": lambda p: _flip(p, 16),
    "truncate half": lambda p: os.truncate(p, p.stat().st_size // 2),
    "truncate to header": lambda p: os.truncate(p, 50),
    "smash a table page": lambda p: _smash_page(p, "segments"),
    "smash an index page": lambda p: _smash_page(p, "sqlite_autoindex_files_1"),
}


def _smash_page(path: Path, name: str) -> None:
    con = sqlite3.connect(path)
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    (root,) = con.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                          (name,)).fetchone()
    con.close()
    data = bytearray(path.read_bytes())
    start = (root - 1) * page_size
    data[start:start + 12] = b"\xff" * 12  # page type and cell counts
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", list(CATALOG_DAMAGE))
def test_damaged_catalog_is_named(tmp_path, damage):
    path = tmp_path / "s"
    built_copy(path)
    catalog = path / "catalog.sqlite"
    CATALOG_DAMAGE[damage](catalog)
    named = re.escape(str(catalog))
    with pytest.raises(CorruptionError, match=named):
        with Store.open(path, read_only=True) as store:
            for name in store.sequences():
                for layer in range(2):
                    store.sequence(name).query(layer, torch.randn(4, 1, 8).half())
            store.verify()


@pytest.mark.parametrize("old,new", [(b'"retrieval_budget": 0.3', b'"retrieval_budget": 0.9'),
                                     (b"model-x", b"model-y")])
def test_changed_config_or_sequence_row_is_caught(tmp_path, old, new):
    """Edits SQLite cannot see (a config value, a model fingerprint) break a row checksum."""
    path = tmp_path / "s"
    built_copy(path)
    catalog = path / "catalog.sqlite"
    data = catalog.read_bytes()
    assert data.count(old) == 1
    catalog.write_bytes(data.replace(old, new))
    with pytest.raises(CorruptionError, match=re.escape(str(catalog)) + ".*fails its checksum"):
        Store.open(path, read_only=True)
