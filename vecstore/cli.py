"""The ``vecstore`` command: inspect, check and maintain stores; run the demo and benchmarks.

Exit status: 0 on success, 1 when a check fails or an error occurs (the message names
the file or setting at fault), 2 for a usage error.

Only the standard library and :mod:`vecstore.errors` are imported up front: ``--help``
and usage errors answer without importing torch. Each command imports the store when
it runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from vecstore.errors import VecstoreError

if TYPE_CHECKING:
    from vecstore.engine.store import Store

__all__ = ["main"]

_FORWARDED = {("demo",): "integrations.demo", ("bench", "accuracy"): "benchmarks.accuracy"}


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` by default); returns the exit status.

    Examples
    --------
    >>> import tempfile
    >>> from vecstore import Store
    >>> path = tempfile.mkdtemp()
    >>> Store.open(path).close()
    >>> main(["verify", path])
    ok: 0 files (0.0 MiB), 0 segments, 0 clusters, 0 steady chunks checked
    0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    for prefix, module in _FORWARDED.items():
        if tuple(args[:len(prefix)]) == prefix:
            return _forward(" ".join(prefix), module, args[len(prefix):])
    ns = _parser().parse_args(args)
    run: Callable[[argparse.Namespace], int] = ns.run
    try:
        return run(ns)
    except VecstoreError as exc:
        print(f"vecstore {ns.command}: error: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vecstore", description="Inspect, check and maintain vecstore stores.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="sequences, segments, clusters, sizes and disk use")
    p.add_argument("path", help="store directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_info)
    p = sub.add_parser("verify", help="check every checksum and catalog reference "
                                      "(exit 1 naming each bad file)")
    p.add_argument("path", help="store directory")
    p.set_defaults(run=_verify)
    p = sub.add_parser("drop", help="delete a sequence and its files")
    p.add_argument("path", help="store directory")
    p.add_argument("name", help="sequence name")
    p.set_defaults(run=_drop)
    p = sub.add_parser("gc", help="remove files no catalog row names (left by crashes)")
    p.add_argument("path", help="store directory")
    p.add_argument("--force", action="store_true",
                   help="also remove files newer than the catalog's last commit (kept by "
                        "default: they may hold commits lost with the catalog's -wal file)")
    p.set_defaults(run=_gc)
    sub.add_parser("demo", help="generate with a Hugging Face model through vecstore "
                                "(arguments go to the demo; try 'vecstore demo --help')")
    p = sub.add_parser("bench", help="benchmarks (arguments after the suite go to it)")
    p.add_argument("suite", choices=["accuracy"], help="which benchmark")
    return parser


def _forward(command: str, module: str, argv: list[str]) -> int:
    try:
        entry = importlib.import_module(module).main
    except ImportError as exc:
        where = ", run from a source checkout" if module.startswith("benchmarks.") else ""
        print(f"vecstore {command}: error: cannot import {module} ({exc}); it needs the "
              f"Hugging Face extra: pip install 'vecstore[hf]'{where}", file=sys.stderr)
        return 1
    status = entry(argv)
    return int(status or 0)


def _store() -> type[Store]:
    from vecstore.engine.store import Store
    return Store


def _info(ns: argparse.Namespace) -> int:
    with _store().open(ns.path, read_only=True) as store:
        info = store.info()
    print(json.dumps(info.to_dict(), indent=2) if ns.json else info.summary())
    return 0


def _verify(ns: argparse.Namespace) -> int:
    with _store().open(ns.path, read_only=True) as store:
        report = store.verify(raise_on_error=False)
    print(report.summary())
    return 0 if report.ok else 1


def _drop(ns: argparse.Namespace) -> int:
    with _store().open(ns.path) as store:
        store.drop(ns.name)
    print(f"dropped {ns.name!r} from {ns.path}")
    return 0


def _gc(ns: argparse.Namespace) -> int:
    with _store().open(ns.path) as store:
        report = store.gc(force=ns.force)
    for rel in report.removed:
        print(f"removed {rel}")
    print(f"freed {report.bytes_freed} bytes in {len(report.removed)} files and directories")
    for rel in report.kept:
        print(f"vecstore gc: kept {rel}: newer than the catalog's last commit, it may hold a "
              "commit lost with the catalog's -wal file (see 'vecstore verify'); "
              "'vecstore gc --force' removes it", file=sys.stderr)
    return 1 if report.kept else 0
