"""Crash safety and concurrent readers, with real processes.

A writer process is SIGKILLed at random times and at its durability steps (the n-th
fsync or rename); after each kill the store must open, verify, and hold exactly the
committed operations (plus, at most, the one in flight, whole).
"""

from __future__ import annotations

import os
import random
import signal
import time

from tests.vecstore.persistence.persist_helpers import config
from tests.vecstore.persistence.writer_process import WriterServer, observe, replay
from vecstore import Store
from vecstore.errors import SequenceDroppedError

TIMED_KILLS = 20
STEP_KILLS = 12


def test_sigkilled_writer_never_loses_or_half_writes(tmp_path):
    """Kills land once the writer has opened the store: timed ones that long after it
    logged ``open``, step ones at the n-th durability step after it opened. A kill that
    still lands before (a slow start) is not counted and its kill point is tried again.
    The test prints the kill points and losses."""
    store, log = tmp_path / "s", tmp_path / "log"
    log.touch()
    rng = random.Random(20261129)
    model: dict[str, list[int]] = {}
    seen = 0
    kill_points = [("time", rng.uniform(0.05, 0.6)) for _ in range(TIMED_KILLS)]
    kill_points += [("step", rng.randrange(1, 30)) for _ in range(STEP_KILLS)]
    rng.shuffle(kill_points)
    counted: list[tuple[str, float]] = []
    early = mid_op = committed_ops = 0
    losses: list[object] = []
    with WriterServer() as server:
        for i in range(3 * len(kill_points)):
            if len(counted) == len(kill_points):
                break
            kind, at = kill_points[len(counted)]
            pid = server.run(store, log, i, "mixed", kill_after=int(at) if kind == "step" else 0)
            if kind == "time":
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and f"open {i}\n" not in log.read_text():
                    time.sleep(0.005)
                time.sleep(at)
            else:
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline and _alive(pid):
                    time.sleep(0.02)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            status = server.wait(pid)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
            lines = log.read_text().splitlines()[seen:]
            seen += len(lines)
            if f"open {i}" not in lines:
                early += 1  # killed before the store was open: try this kill point again
                continue
            counted.append((kind, at))
            model, inflight = replay(lines, model)
            committed_ops += sum(line.startswith("commit") for line in lines)
            mid_op += inflight is not None
            actual = observe(store, verify=True)
            if actual != model and actual != inflight:
                losses.append((kind, at, actual, model, inflight))
            model = actual
    print(f"\ncrash test: {len(counted)} kill points after open ({TIMED_KILLS} timed, "
          f"{STEP_KILLS} at durability steps; {mid_op} mid-operation), {early} early kills "
          f"not counted, {committed_ops} committed operations, {len(losses)} losses")
    assert losses == []
    assert len(counted) == len(kill_points) and committed_ops > 100 and mid_op > 5
    with Store.open(store) as writer:  # a writer takes over and cleans up
        writer.gc()
        report = writer.verify()
        assert report.unreferenced == [] and report.lost == []


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_readers_in_other_processes_see_only_committed_states(tmp_path):
    """The writer appends to all layers in transactions while this process reads: every
    snapshot has all layers at one committed length, and lengths never go back."""
    store, log = tmp_path / "s", tmp_path / "log"
    log.touch()
    with Store.open(store, config()):  # create it, so readers can start at once
        pass
    last: dict[str, int] = {}
    reads = 0
    with WriterServer() as server:
        pid = server.run(store, log, 1, "txn")
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            try:
                state = observe(store, verify=False)
            except SequenceDroppedError:
                continue  # dropped by the writer between our open and our query
            for name, counts in state.items():
                assert len(set(counts)) == 1, counts  # a transaction is all or nothing
                assert counts[0] >= last.get(name, 0)
                last[name] = counts[0]
            reads += 1
        os.kill(pid, signal.SIGKILL)
        server.wait(pid)
    committed: dict[str, set[int]] = {}
    for line in log.read_text().splitlines():
        if line.startswith("commit txn"):
            committed.setdefault(line.split()[2], set()).add(int(line.split()[3]))
    assert reads >= 5 and sum(last.values()) > 0
    for name, n in last.items():
        assert n == 0 or n in committed[name]  # a length some transaction committed
    assert observe(store, verify=True)
