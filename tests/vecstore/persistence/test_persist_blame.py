"""When a catalog row and a data file disagree, the error names the one at fault; verify
counts every file it checked in its totals."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from pathlib import Path

import pytest
import torch

from tests.vecstore.persistence.persist_helpers import built_copy
from vecstore import Store
from vecstore.errors import CorruptionError
from vecstore.plugins import check_plugins
from vecstore.storage.persistence import Persistence
from vecstore.storage.verify import verify_store


def _sql(path: Path, *statements: str) -> None:
    con = sqlite3.connect(path / "catalog.sqlite")
    for st in statements:
        con.execute(st)
    con.commit()
    con.close()


def _first_file(path: Path) -> tuple[int, Path]:
    con = sqlite3.connect(path / "catalog.sqlite")
    (fid, rel) = con.execute("SELECT f.id, f.path FROM files f JOIN sequences s ON "
                             "f.sequence_id = s.id WHERE s.name = 'a' ORDER BY f.path "
                             "LIMIT 1").fetchone()
    con.close()
    return fid, path / rel


def _forge_sequence(path: Path, **values: object) -> None:
    """Change sequence 'a''s row and recompute its checksum, as a forger would."""
    con = sqlite3.connect(path / "catalog.sqlite")
    for k, v in values.items():
        con.execute(f"UPDATE sequences SET {k} = ? WHERE name = 'a'", (v,))
    row = con.execute("SELECT name, directory, num_layers, num_kv_heads, head_dim, dtype, "
                      "device, fingerprint FROM sequences WHERE name = 'a'").fetchone()
    digest = hashlib.sha256(json.dumps(list(row)).encode()).hexdigest()
    con.execute("UPDATE sequences SET checksum = ? WHERE name = 'a'", (f"sha256:{digest}",))
    con.commit()
    con.close()


def _query_all(store: Store) -> None:
    for name in store.sequences():
        for layer in range(2):
            store.sequence(name).query(layer, torch.randn(4, 1, 8).half())


@pytest.mark.parametrize("edit", ["size = size + 1", "checksum = 'sha256:' || hex(zeroblob(32))"])
def test_an_altered_files_row_blames_the_catalog(tmp_path, edit):
    path = tmp_path / "s"
    built_copy(path)
    fid, data = _first_file(path)
    _sql(path, f"UPDATE files SET {edit} WHERE id = {fid}")
    catalog = re.escape(str(path / "catalog.sqlite"))
    with Store.open(path, read_only=True) as store:
        with pytest.raises(CorruptionError, match=catalog + ".*row was altered, not the file"):
            _query_all(store)
        problems = store.verify(raise_on_error=False).problems
        assert len(problems) == 1 and problems[0].startswith(f"catalog {path / 'catalog.sqlite'}")


@pytest.mark.parametrize("values,match", [
    ({"dtype": "int8"}, "dtype 'int8'"), ({"num_kv_heads": 0}, "num_kv_heads = 0"),
    ({"head_dim": 2 ** 40}, "head_dim"), ({"device": "tpu:9"}, "device 'tpu:9'"),
])
def test_a_forged_sequence_row_blames_the_catalog(tmp_path, values, match):
    path = tmp_path / "s"
    built_copy(path)
    _forge_sequence(path, **values)
    with pytest.raises(CorruptionError, match=re.escape(str(path / "catalog.sqlite")) +
                       " is corrupt: sequence 'a' records " + re.escape(match)):
        Store.open(path, read_only=True)


@pytest.mark.parametrize("table", ["segments", "layers"])
def test_an_altered_index_kind_blames_the_catalog(tmp_path, table):
    path = tmp_path / "s"
    built_copy(path)
    _sql(path, f"UPDATE {table} SET index_kind = 'quest' WHERE id = (SELECT min(id) FROM "
               f"{table} WHERE {'layer_id' if table == 'segments' else 'layer'} = "
               f"{'(SELECT min(layer_id) FROM segments)' if table == 'segments' else 0})")
    catalog = re.escape(str(path / "catalog.sqlite"))
    with pytest.raises(CorruptionError, match=catalog + r" is corrupt: .* index kind"):
        Store.open(path, read_only=True)
    p, _ = Persistence.open(path, None, read_only=True,  # verify reads rows, not sequences
                            check_config=check_plugins)
    try:
        assert any("index kind" in problem for problem in verify_store(p).problems)
    finally:
        p.close()


def test_a_non_utf8_path_is_catalog_corruption(tmp_path):
    path = tmp_path / "s"
    built_copy(path)
    fid, _ = _first_file(path)
    _sql(path, f"UPDATE files SET path = CAST(X'646174612fff' AS TEXT) WHERE id = {fid}")
    with pytest.raises(CorruptionError, match=re.escape(str(path / "catalog.sqlite")) +
                       " is corrupt.*UTF-8"):
        with Store.open(path, read_only=True) as store:
            store.verify()


def test_verify_totals_include_a_bad_file(tmp_path):
    path = tmp_path / "s"
    built_copy(path)
    with Store.open(path, read_only=True) as store:
        good = store.verify()
    _, data = _first_file(path)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x5A
    data.write_bytes(bytes(raw))
    with Store.open(path, read_only=True) as store:
        bad = store.verify(raise_on_error=False)
    assert len(bad.problems) == 1 and str(data) in bad.problems[0]
    assert (bad.files_checked, bad.bytes_checked, bad.segments, bad.clusters) == (
        good.files_checked, good.bytes_checked, good.segments, good.clusters)
