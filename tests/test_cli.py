"""The ``vecstore`` command line: info, verify, drop, gc, and the forwarded commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from tests.vecstore.persistence.persist_helpers import built_copy, data_files
from vecstore import Store
from vecstore.cli import main


def test_info_prints_a_table_and_json(tmp_path, capsys):
    built_copy(tmp_path / "s")
    assert main(["info", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "disk/raw" in out and "\na " in out and "\nb " in out
    assert main(["info", str(tmp_path / "s"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [q["name"] for q in info["sequences"]] == ["a", "b"]
    assert info["sequences"][0]["num_tokens"] == 205


def test_verify_passes_then_names_the_bad_file(tmp_path, capsys):
    built_copy(tmp_path / "s")
    assert main(["verify", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    bad = data_files(tmp_path / "s")[0]
    os.truncate(bad, 100)
    assert main(["verify", str(tmp_path / "s")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and str(bad) in out


def test_verify_names_a_broken_catalog(tmp_path, capsys):
    built_copy(tmp_path / "s")
    catalog = tmp_path / "s" / "catalog.sqlite"
    os.truncate(catalog, catalog.stat().st_size // 2)
    assert main(["verify", str(tmp_path / "s")]) == 1
    assert str(catalog) in capsys.readouterr().err


def test_drop_and_gc(tmp_path, capsys):
    built_copy(tmp_path / "s")
    orphan = tmp_path / "s" / "data" / "deadbeefdeadbeef" / "0000-000000000000.safetensors"
    orphan.parent.mkdir()
    orphan.write_bytes(b"left by a crash")
    os.utime(orphan, (1e9, 1e9))  # older than the last commit: a leftover, not a lost commit
    assert main(["drop", str(tmp_path / "s"), "a"]) == 0
    assert "dropped 'a'" in capsys.readouterr().out
    assert main(["drop", str(tmp_path / "s"), "a"]) == 1
    assert "no sequence 'a'" in capsys.readouterr().err
    assert main(["gc", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "removed data/deadbeefdeadbeef/0000-000000000000.safetensors" in out
    assert not orphan.parent.exists()
    with Store.open(tmp_path / "s", read_only=True) as store:
        assert store.sequences() == ["b"] and store.verify().ok


def test_errors_exit_1_with_a_message(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 1
    assert "no store" in capsys.readouterr().err
    with Store.open(tmp_path / "s"):
        assert main(["gc", str(tmp_path / "s")]) == 1  # a writer holds it
        assert "already open for writing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv,module,rest", [
    (["demo", "--model", "x", "-n", "3"], "integrations.demo", ["--model", "x", "-n", "3"]),
    (["bench", "accuracy", "--quick"], "benchmarks.accuracy", ["--quick"]),
    (["demo"], "integrations.demo", []),
])
def test_demo_and_bench_forward_the_rest(monkeypatch, argv, module, rest):
    seen = []
    fake = types.ModuleType(module)
    fake.main = lambda args: seen.append(args) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, fake)
    assert main(argv) == 3
    assert seen == [rest]


def test_bench_needs_a_known_suite(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "speed"])
    assert "invalid choice" in capsys.readouterr().err


def test_console_script_runs(tmp_path):
    Store.open(tmp_path / "s").close()
    exe = os.path.join(os.path.dirname(sys.executable), "vecstore")
    done = subprocess.run([exe, "verify", str(tmp_path / "s")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: 0 files")
