"""A failed ``Store.open`` raises a vecstore error naming the path and leaves the
directory exactly as it was; a store on read-only media opens for reading."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import sqlite3
from pathlib import Path

import pytest
import torch

from tests.vecstore.persistence.dirstate import remount, snapshot, tmpfs
from tests.vecstore.persistence.persist_helpers import answers, built_copy, config
from vecstore import Store
from vecstore.errors import (
    CatalogError,
    ConfigError,
    IncompatibleError,
    InvalidValueError,
    LockedError,
    NotFoundError,
    StorageError,
)


def _paths(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "file").write_text("x")
    (tmp / "loop").symlink_to(tmp / "loop")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    return {
        "under a file": (tmp / "file" / "s", "a component of it is a file"),
        "300-character component": (tmp / ("x" * 300), "longer than the file system allows"),
        "symlink loop": (tmp / "loop", "loop of symbolic links"),
        "under a symlink loop": (tmp / "loop" / "s", "loop of symbolic links"),
        "dangling symlink": (tmp / "dangling", "symbolic link to nothing"),
    }


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("case", ["under a file", "300-character component", "symlink loop",
                                  "under a symlink loop", "dangling symlink"])
def test_unusable_paths_are_invalid_values(tmp_path, case, read_only):
    path, reason = _paths(tmp_path)[case]
    before = snapshot(tmp_path)
    with pytest.raises(InvalidValueError, match=re.escape(reason)):
        Store.open(path, read_only=read_only)
    assert snapshot(tmp_path) == before


def _foreign_sqlite(path: Path, wal: bool) -> None:
    con = sqlite3.connect(path)
    if wal:
        con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE notes (x)")
    con.execute("INSERT INTO notes VALUES ('mine')")
    con.commit()
    con.close()


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("catalog,err,match", [
    ("rollback sqlite", CatalogError, "not a vecstore catalog"),
    ("wal sqlite", CatalogError, "not a vecstore catalog"),
    ("empty file", CatalogError, "empty file, not a vecstore catalog"),
    ("garbage", CatalogError, "catalog.sqlite"),
])
def test_a_foreign_catalog_is_refused_untouched(tmp_path, catalog, err, match, read_only):
    d = tmp_path / "s"
    d.mkdir()
    target = d / "catalog.sqlite"
    if catalog.endswith("sqlite"):
        _foreign_sqlite(target, wal=catalog == "wal sqlite")
    else:
        target.write_bytes(b"" if catalog == "empty file" else b"not sqlite at all" * 300)
    before = snapshot(d)
    with pytest.raises(err, match=match):
        Store.open(d, read_only=read_only)
    assert snapshot(d) == before  # no LOCK, no data/, no journal-mode switch


@pytest.mark.parametrize("bad", [{"index": {"kind": "bogus"}}, {"cluster": {"kind": "bogus"}},
                                 {"executor": {"kind": "bogus"}}, {"cache": {"policy": "bogus"}}])
def test_unknown_plugins_create_nothing(tmp_path, bad):
    with pytest.raises(ConfigError, match="unknown .*'bogus'"):
        Store.open(tmp_path / "new", config=bad)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="bogus"):
        Store.open(tmp_path / "empty", config=bad)
    assert os.listdir(tmp_path / "empty") == []
    with Store.open(tmp_path / "new") as store:  # the directory is still usable
        assert store.sequences() == []


@pytest.mark.parametrize("read_only", [False, True])
def test_conflicting_or_locked_opens_change_nothing(tmp_path, read_only):
    built_copy(tmp_path / "s")
    before = snapshot(tmp_path / "s")
    bad = {**config(), "index": {**config()["index"], "tokens_per_cluster": 8}}
    with pytest.raises(IncompatibleError, match="tokens_per_cluster"):
        Store.open(tmp_path / "s", bad, read_only=read_only)
    assert snapshot(tmp_path / "s") == before


def test_a_held_lock_wins_over_any_check(tmp_path):
    built_copy(tmp_path / "s")
    with Store.open(tmp_path / "s"):
        with pytest.raises(LockedError, match="close that writer first") as exc:
            Store.open(tmp_path / "s", {"index": {"tokens_per_cluster": 99}})
        assert "read_only=True" not in str(exc.value)


def test_stored_config_naming_unknown_plugins_blames_the_catalog(tmp_path):
    built_copy(tmp_path / "s")
    con = sqlite3.connect(tmp_path / "s" / "catalog.sqlite")
    (cfg,) = con.execute("SELECT config_json FROM store").fetchone()
    cfg = cfg.replace('"kind": "wave"', '"kind": "bogus"')
    con.execute("UPDATE store SET config_json = ?, config_checksum = ?",
                (cfg, "sha256:" + hashlib.sha256(cfg.encode()).hexdigest()))
    con.commit()
    con.close()
    before = snapshot(tmp_path / "s")
    for read_only in (False, True):
        with pytest.raises(CatalogError, match=r"catalog\.sqlite: its stored config .*bogus"):
            Store.open(tmp_path / "s", read_only=read_only)
    assert snapshot(tmp_path / "s") == before


def test_read_only_media(tmp_path):
    """A writer gets a StorageError naming the store (nothing changes); a reader opens the
    store immutably (WAL mode would need a -shm file) and reads everything."""
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        if mnt is None:
            pytest.skip("needs root to mount a read-only tmpfs")
        want = built_copy(mnt / "s")
        remount(mnt, "ro")
        before = snapshot(mnt / "s")
        with pytest.raises(StorageError, match=re.escape(str(mnt / "s")) + ".*read-only") as exc:
            Store.open(mnt / "s")
        assert exc.value.errno == errno.EROFS and "read_only=True" not in str(exc.value)
        with pytest.raises(StorageError, match="read-only"):
            Store.open(mnt / "new")
        with Store.open(mnt / "s", read_only=True) as store:
            assert store.sequences() == ["a", "b"]
            got = answers(store.sequence("a"))
            assert all(torch.equal(x[0], y[0]) for x, y in zip(got, want, strict=True))
            assert store.verify().ok
        assert snapshot(mnt / "s") == before
        remount(mnt, "rw")


def test_missing_stores_and_bad_toml(tmp_path):
    with pytest.raises(NotFoundError, match="no store"):
        Store.open(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()
    toml = tmp_path / "cfg.toml"
    toml.write_bytes(b"[attention]\nretrieval_budget = 0.1 # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"cfg\.toml.*not UTF-8"):
        Store.open(tmp_path / "s", config=toml)
    assert not (tmp_path / "s").exists()


def test_cli_errors_speak_to_a_shell_user(tmp_path, capsys):
    from vecstore.cli import main

    built_copy(tmp_path / "s")
    with Store.open(tmp_path / "s"):
        for argv in (["gc", str(tmp_path / "s")], ["drop", str(tmp_path / "s"), "a"]):
            assert main(argv) == 1
            err = capsys.readouterr().err
            assert "close that writer first" in err and "=True" not in err
