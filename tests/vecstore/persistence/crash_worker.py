"""A writer process for the crash and concurrency tests.

Run as ``python crash_worker.py``: it imports vecstore once, then reads commands on
stdin and forks one child per ``run`` command, so each kill point costs a fork, not a
Python start (torch takes seconds to import). The server itself never runs torch ops,
so forking it is safe.

Commands (one per line; each answer is one line on stdout):

- ``run STORE LOG SEED MODE KILL_AFTER``: fork a child writing STORE and logging to
  LOG; answers ``pid N``. MODE ``mixed`` interleaves per-layer appends, transactions,
  creations and drops; ``txn`` only appends in all-layer transactions. With
  ``KILL_AFTER > 0`` the child SIGKILLs itself at that call of ``os.fsync`` or
  ``os.replace`` (the durability steps) after the store is open, just before making it.
- ``wait N``: reap child N; answers ``done STATUS``.

The log gets ``open SEED`` once the store is open (a kill before it hit no store
operation), then ``begin ...`` before and ``commit ...`` after each operation, so after a
kill the checker knows what committed and what was in flight:
``create NAME``, ``drop NAME``, ``append NAME LAYER TOTAL``, ``txn NAME TOTAL``.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import zlib
from typing import IO

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))))

from tests.vecstore.persistence.persist_helpers import DIM, HEADS, LAYERS, config, stream  # noqa: E402
from vecstore import Store  # noqa: E402

MAX_TOKENS = 400


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode()) % 100_000


def _arm_kill(after: int) -> None:
    calls = [0]
    for fn_name in ("fsync", "replace"):
        real = getattr(os, fn_name)

        def wrapped(*args: object, _real=real) -> object:
            calls[0] += 1
            if calls[0] >= after:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args)

        setattr(os, fn_name, wrapped)


def _append(seq, layer: int, total: int) -> None:
    have = seq.tokens(layer)
    k, v = stream(seed_of(seq.name), layer, total)
    seq.append(layer, k[:, have:], v[:, have:])


def _op(store: Store, rng: random.Random, mode: str, tag: str, log: IO[str]) -> None:
    names = store.sequences()
    if len(names) < 2 or (mode == "mixed" and rng.random() < 0.05):
        name = f"s{tag}{rng.randrange(10**9)}"
        log.write(f"begin create {name}\n")
        store.create(name, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                     dtype="float16")
        log.write(f"commit create {name}\n")
        return
    name = rng.choice(names)
    seq = store.sequence(name)
    if max(seq.tokens(i) for i in range(LAYERS)) > MAX_TOKENS:
        log.write(f"begin drop {name}\n")
        store.drop(name)
        log.write(f"commit drop {name}\n")
        return
    n = rng.choice([1, 1, 1, 2, 5, rng.randrange(1, 90)])
    if mode == "txn" or rng.random() < 0.4:
        total = max(seq.tokens(i) for i in range(LAYERS)) + n
        log.write(f"begin txn {name} {total}\n")
        with store.transaction():
            for layer in range(LAYERS):
                _append(seq, layer, total)
        log.write(f"commit txn {name} {total}\n")
        return
    for layer in range(LAYERS):
        total = seq.tokens(layer) + n
        log.write(f"begin append {name} {layer} {total}\n")
        _append(seq, layer, total)
        log.write(f"commit append {name} {layer} {total}\n")


def child(store_path: str, log_path: str, seed: int, mode: str, kill_after: int) -> None:
    import torch

    torch.set_num_threads(1)
    rng = random.Random(seed)
    with open(log_path, "a", buffering=1) as log:
        with Store.open(store_path, config()) as store:
            log.write(f"open {seed}\n")
            if kill_after > 0:
                _arm_kill(kill_after)
            for _ in range(100_000):
                _op(store, rng, mode, str(seed), log)


def serve() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "run":
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    child(args[0], args[1], int(args[2]), args[3], int(args[4]))
                except BaseException as exc:  # report, then leave without cleanup
                    print(f"child error: {exc!r}", file=sys.stderr, flush=True)
                    code = 1
                os._exit(code)
            print(f"pid {pid}", flush=True)
        elif cmd == "wait":
            _, status = os.waitpid(int(args[0]), 0)
            print(f"done {status}", flush=True)


if __name__ == "__main__":
    serve()
