"""The catalog's ``-wal`` file is part of the store: losing or damaging it after a crash
is detected (verify fails, gc keeps the data files), and a reader's verify beside a
writer reports no false corruption."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.vecstore.persistence.persist_helpers import (
    DIM,
    HEADS,
    LAYERS,
    built_copy,
    config,
    data_files,
    fill,
)
from vecstore import Store
from vecstore.cli import main
from vecstore.errors import CorruptionError
from vecstore.storage import orphans


def _crashed_copy(tmp_path: Path, wal: str) -> tuple[Path, list[str]]:
    """A store copied while its writer had commits only in the -wal (as a crash leaves
    it), with the -wal ``"lost"``, ``"damaged"`` or ``"kept"``; returns it and the data
    files those commits wrote."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    with Store.open(src, config()) as store:
        seq = store.create("a", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                           dtype=torch.float16)
        fill(seq, 1, [30])
        with store.transaction():
            fill(store.create("b", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                              dtype=torch.float16), 2, [120])
        dst.mkdir()
        for f in ("LOCK", "catalog.sqlite", "data"):
            (shutil.copytree if f == "data" else shutil.copy2)(src / f, dst / f)
        committed = {str(p.relative_to(src)) for p in data_files(src)}
        if wal != "lost":
            shutil.copy2(src / "catalog.sqlite-wal", dst / "catalog.sqlite-wal")
        if wal == "damaged":
            w = dst / "catalog.sqlite-wal"
            data = bytearray(w.read_bytes())
            data[len(data) // 3] ^= 0xFF  # a frame's checksum fails: SQLite stops there
            w.write_bytes(bytes(data))
    return dst, sorted(committed)


@pytest.mark.parametrize("wal", ["lost", "damaged"])
def test_a_lost_or_damaged_wal_is_detected_and_gc_keeps_the_data(tmp_path, wal, capsys,
                                                                 monkeypatch):
    # here the -wal is lost or damaged (and recreated by the next open) at once, not at a
    # restart seconds after the commit
    monkeypatch.setattr(orphans, "WAL_SLACK_S", 0.0)
    path, files = _crashed_copy(tmp_path, wal)
    with Store.open(path, read_only=True) as store:
        report = store.verify(raise_on_error=False)
        assert "b" not in store.sequences()  # the catalog fell back to an older state
        assert not report.ok and report.lost and set(report.lost) <= set(files)
        assert report.unreferenced == []
        with pytest.raises(CorruptionError, match=r"-wal file .* was probably lost"):
            store.verify()
    assert main(["verify", str(path)]) == 1
    assert "newer than the catalog's last commit" in capsys.readouterr().out
    assert main(["gc", str(path)]) == 1  # kept, and said so
    assert "gc --force" in capsys.readouterr().err
    assert all((path / f).exists() for f in report.lost)
    with Store.open(path) as store:
        kept = store.gc()
        assert kept.removed == [] and kept.kept == report.lost
    assert main(["gc", "--force", str(path)]) == 0
    with Store.open(path, read_only=True) as store:
        after = store.verify()
        assert after.ok and after.lost == [] and after.unreferenced == []


def test_an_intact_wal_loses_nothing(tmp_path):
    path, files = _crashed_copy(tmp_path, "kept")
    with Store.open(path, read_only=True) as store:
        report = store.verify()
        assert store.sequences() == ["a", "b"] and store.sequence("b").num_tokens == 120
        assert report.ok and report.lost == [] and report.unreferenced == []


@pytest.mark.parametrize("before_wal", [0.0, 2.0], ids=["after-wal", "just-before-wal"])
def test_leftovers_of_a_crashed_commit_are_not_lost_data(tmp_path, before_wal):
    """A data file written after the last commit and after the -wal's last write (a
    writer killed before its catalog transaction), or just before it (killed inside the
    transaction: its -wal frames written, the commit frame not), is a leftover that gc
    removes."""
    path, files = _crashed_copy(tmp_path, "kept")
    leftover = path / files[0].replace("0000-", "0001-9")
    shutil.copy2(path / files[0], leftover)
    os.utime(leftover)  # written now: after the last commit
    if before_wal:
        at = os.stat(leftover).st_mtime + before_wal
        os.utime(path / "catalog.sqlite-wal", (at, at))
    with Store.open(path, read_only=True) as store:
        report = store.verify()
        assert report.ok and report.lost == []
        assert report.unreferenced == [str(leftover.relative_to(path))]
    with Store.open(path) as store:
        assert store.gc().removed == [str(leftover.relative_to(path))]


def test_verify_beside_a_writer_that_drops_and_appends(tmp_path):
    """A reader's verify runs from its snapshot: files of sequences dropped since are
    gone, and files committed since are named by no row of the snapshot; neither is a
    problem."""
    built_copy(tmp_path / "s")
    with Store.open(tmp_path / "s", read_only=True) as reader:
        with Store.open(tmp_path / "s") as writer:
            writer.drop("a")
            fill(writer.sequence("b"), 2, [20, 200])
        report = reader.verify()
        assert report.ok and report.unreferenced == [] and report.lost == []
        assert report.segments > 0  # it checked the snapshot's segments of "a" too



def test_a_writer_never_reads_the_main_file_alone_while_a_wal_exists(tmp_path, monkeypatch):
    # a writer killed while checkpointing leaves pages of two versions in the main file,
    # which only the -wal makes whole: read alone it was "malformed" (the crash test saw it
    # once in CI), so a writer's checks must go through SQLite whenever a -wal exists
    from vecstore.catalog.catalog import Catalog

    dst, _ = _crashed_copy(tmp_path, "kept")
    opened = []
    real = Catalog.open.__func__

    def recording(cls, path, *, read_only, immutable=False):
        opened.append(immutable)
        return real(cls, path, read_only=read_only, immutable=immutable)

    monkeypatch.setattr(Catalog, "open", classmethod(recording))
    with Store.open(dst) as store:
        assert store.sequences() == ["a", "b"]
    assert opened and not any(opened)
