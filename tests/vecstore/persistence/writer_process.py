"""Drive :mod:`crash_worker` from a test, and check a store against the worker's log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.vecstore.persistence.crash_worker import seed_of
from tests.vecstore.persistence.persist_helpers import LAYERS, expected_rows, stored_rows
from vecstore import Store

ROOT = Path(__file__).resolve().parents[3]


class WriterServer:
    """The forking server of :mod:`crash_worker`; use as a context manager."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("crash_worker.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def run(self, store: Path, log: Path, seed: int, mode: str, kill_after: int = 0) -> int:
        answer = self._ask(f"run {store} {log} {seed} {mode} {kill_after}")
        assert answer.startswith("pid "), answer
        return int(answer.split()[1])

    def wait(self, pid: int) -> int:
        answer = self._ask(f"wait {pid}")
        assert answer.startswith("done "), answer
        return int(answer.split()[1])

    def __enter__(self) -> WriterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


Model = dict[str, list[int]]


def replay(lines: list[str], model: Model) -> tuple[Model, Model | None]:
    """Apply committed operations of ``lines`` to ``model``; returns it and, if the
    last operation began but did not commit, the model it would have produced."""
    inflight: Model | None = None
    for line in lines:
        if not line.startswith(("begin ", "commit ")):
            continue  # "open SEED"
        phase, op, *args = line.split()
        after = _apply(model, op, args)
        if phase == "begin":
            inflight = after
        else:
            model, inflight = after, None
    return model, inflight


def _apply(model: Model, op: str, args: list[str]) -> Model:
    out = {k: list(v) for k, v in model.items()}
    if op == "create":
        out[args[0]] = [0] * LAYERS
    elif op == "drop":
        out.pop(args[0], None)
    elif op == "append":
        out[args[0]][int(args[1])] = int(args[2])
    elif op == "txn":
        out[args[0]] = [int(args[1])] * LAYERS
    return out


def observe(path: Path, *, verify: bool) -> Model:
    """The state of the store at ``path`` (checking every token's content, and with
    ``verify`` the whole store)."""
    with Store.open(path, read_only=True) as store:
        if verify:
            report = store.verify(raise_on_error=False)
            assert report.ok, (report.problems, report.lost)
        state = {}
        for name in store.sequences():
            seq = store.sequence(name)
            counts = [seq.tokens(layer) for layer in range(LAYERS)]
            for layer, n in enumerate(counts):
                if n:
                    got = stored_rows(seq, layer)
                    assert torch.equal(got, expected_rows(seed_of(name), layer, n)), (name, n)
            state[name] = counts
        return state
