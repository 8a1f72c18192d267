"""benchmarks/first_query.py on the CPU: a batch appended together is queried from the rows
it placed (the tier holds its KV once), one appended apart is copied into a stack first
(twice, one layer at a time)."""

from __future__ import annotations

import json

import pytest

from benchmarks.first_query import main, parse_args


def test_rows_placed_together_are_not_copied_by_the_first_query(tmp_path):
    main(["--device", "cpu", "--batch", "2", "--context", "600", "--heads", "2", "--dim",
          "16", "--chunk", "100", "--index", "flat", "--out", str(tmp_path)])
    rows = {r["placement"]: r for r in json.loads(
        (tmp_path / "first_query.json").read_text())["rows"]}
    kv = 2 * 2 * 2 * (600 - 4 - 64) * 16 * 4 * 2 / 1e9  # layers x rows x heads x indexed
    assert rows["together"]["peak_gb"] == pytest.approx(kv)
    assert rows["apart"]["peak_gb"] == pytest.approx(1.5 * kv)  # a layer's stack beside it
    assert all(r["first_query_s"] > 0 and r["second_query_s"] > 0 for r in rows.values())
    assert "| together |" in (tmp_path / "first_query.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--batch", "1"], "a batch needs at least 2 sequences"),
    (["--chunk", "0"], "must be at least 1"),
    (["--kvstore", "disk"], "invalid choice: 'disk'"),
])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
