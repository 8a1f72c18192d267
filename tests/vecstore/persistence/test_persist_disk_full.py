"""A full disk during a commit: a StorageError naming the store's file, everything
rolled back (in memory and on disk), and the same write succeeding once there is room.

As root (CI) the store lives on a small tmpfs filled up by a ballast file; elsewhere
the durability step of the data file write fails with an injected ``ENOSPC``."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch

from tests.vecstore.persistence.dirstate import snapshot, tmpfs
from tests.vecstore.persistence.persist_helpers import (
    DIM,
    HEADS,
    LAYERS,
    answers,
    config,
    expected_rows,
    stored_rows,
    stream,
)
from vecstore import Store
from vecstore.errors import StorageError


def _fill(path: Path, leave: int) -> Path:
    """A ballast file taking all but about ``leave`` bytes of the file system."""
    ballast = path / "ballast"
    st = os.statvfs(path)
    with open(ballast, "wb") as fh:
        fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return ballast


def _full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A context that yields (store directory, make room)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        with tmpfs(tmp_path / "mnt", "2m") as mnt:
            if mnt is not None:
                root = mnt / "s"
                yield root, lambda: (_fill(mnt, 8 * 1024), lambda: (mnt / "ballast").unlink())
                return
        root = tmp_path / "s"
        real = os.fsync

        def fill():
            def full(fd: int) -> None:
                if "/data/" in os.readlink(f"/proc/self/fd/{fd}"):
                    raise OSError(errno.ENOSPC, "No space left on device")
                real(fd)
            monkeypatch.setattr(os, "fsync", full)
            return lambda: monkeypatch.setattr(os, "fsync", real)

        yield root, lambda: (None, fill())
    return ctx()


def _state(store: Store, root: Path) -> tuple:
    """Names, token counts, a fixed query's output per layer, and the directory's bytes."""
    seq = store.sequence("a")
    outs = tuple(tuple(t.flatten().tolist()) for o, lse, _ in answers(seq) for t in (o, lse))
    return (store.sequences(), [seq.tokens(i) for i in range(LAYERS)], outs, snapshot(root))


@pytest.mark.parametrize("how", ["append", "transaction"])
def test_disk_full_names_the_file_rolls_back_and_retries(tmp_path, monkeypatch, how):
    with _full_disk(tmp_path, monkeypatch) as (root, make_full):
        with Store.open(root, config()) as store:
            seq = store.create("a", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                               dtype=torch.float16)
            streams = [stream(1, layer, 640) for layer in range(LAYERS)]
            for layer, (k, v) in enumerate(streams):
                seq.append(layer, k[:, :40], v[:, :40])
            before = _state(store, root)
            _, free = make_full()

            def write() -> None:
                if how == "append":
                    for layer, (k, v) in enumerate(streams):
                        seq.append(layer, k[:, 40:], v[:, 40:])
                else:
                    with store.transaction():
                        for layer, (k, v) in enumerate(streams):
                            seq.append(layer, k[:, 40:], v[:, 40:])

            with pytest.raises(StorageError, match=re.escape(str(root))) as exc:
                write()
            assert exc.value.errno == errno.ENOSPC
            assert "disk is full" in str(exc.value) and "free space and retry" in str(exc.value)
            assert _state(store, root) == before  # layer 0's segments did not fit either way
            assert store.verify().ok
            free()
            for layer, (k, v) in enumerate(streams):  # the same write now succeeds
                have = seq.tokens(layer)
                seq.append(layer, k[:, have:], v[:, have:])
        with Store.open(root, read_only=True) as store:
            assert store.verify().ok and store.verify().unreferenced == []
            for layer in range(LAYERS):
                assert torch.equal(stored_rows(store.sequence("a"), layer),
                                   expected_rows(1, layer, 640))
