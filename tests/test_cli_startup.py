"""``vecstore --help`` and usage errors answer without importing torch (or numpy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
from vecstore.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
heavy = sorted(m for m in ("torch", "numpy", "transformers", "sqlalchemy") if m in sys.modules)
print(json.dumps({"status": status, "heavy": heavy}), file=sys.stderr)
"""


def _run(*argv: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    return json.loads(done.stderr.strip().splitlines()[-1]), done.stdout + done.stderr


@pytest.mark.parametrize("argv,status,says", [
    (["--help"], 0, "Inspect, check and maintain"),
    (["info", "--help"], 0, "store directory"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["info"], 2, "the following arguments are required: path"),
    (["bench", "speed"], 2, "invalid choice: 'speed'"),
])
def test_help_and_usage_errors_import_no_torch(argv, status, says):
    probe, output = _run(*argv)
    assert probe == {"status": status, "heavy": []}
    assert says in output


def test_vecstore_names_still_import_on_first_use():
    import vecstore

    assert vecstore.Store.__name__ == "Store" and vecstore.Config is vecstore.StoreConfig
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        vecstore.Nope  # noqa: B018
