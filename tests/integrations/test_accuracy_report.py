"""The accuracy harness's planning, summaries and outputs, on synthetic records."""

from __future__ import annotations

import json

from benchmarks.accuracy.harness import method_config, plan_runs
from benchmarks.accuracy.report import environment, summarize, write


def _result(task, method, budget, score, length=8000, exact=0.03):
    return {"task": task, "length": length, "seed": 0, "method": method, "budget": budget,
            "score": score, "answer": "", "prompt_tokens": length, "seconds": 1.0,
            "exact_fraction": 1.0 if method == "full" else exact, "estimated_mass": 0.1}


def _fidelity(method, layer, err):
    return {"task": "t", "method": method, "layer": layer, "rel_error": err,
            "captured_mass": 1 - err, "exact_fraction": 0.03, "estimated_mass": 0.0,
            "context_tokens": 6000}


def test_method_configs_and_run_plans():
    assert method_config("full", 0.018) is None
    assert method_config("quest", 0.05) == {"index": {"kind": "quest"},
                                            "attention": {"retrieval_budget": 0.05}}
    runs = plan_runs(["full", "wave", "quest"], 0.018, ["wave", "quest"], [0.018, 0.05],
                     swept=True)
    assert runs == [("full", 0.0), ("wave", 0.018), ("quest", 0.018), ("wave", 0.05),
                    ("quest", 0.05)]
    assert plan_runs(["wave"], 0.018, ["wave"], [0.05], swept=False) == [("wave", 0.018)]


def test_summary_tables_and_files(tmp_path):
    results = [_result("a", "full", 0.0, 1.0), _result("b", "full", 0.0, 0.5),
               _result("a", "wave", 0.018, 1.0), _result("b", "wave", 0.018, 0.5),
               _result("a", "quest", 0.018, 0.0), _result("b", "quest", 0.018, 0.5),
               _result("a", "wave", 0.05, 1.0, exact=0.06),
               _result("a", "quest", 0.05, 1.0, exact=0.06),
               _result("a", "wave", 0.018, 0.0, length=2048)]
    fidelity = [_fidelity("wave", layer, 0.1 * (layer + 1)) for layer in range(4)]
    summary = summarize(results, fidelity, 0.018, 8000)
    at_8k = summary["by_length"]["8000"]
    assert at_8k["wave"]["vs_full"] == 1.0 and at_8k["quest"]["score"] == 0.25
    assert summary["sweep"]["quest@0.05"]["score"] == 1.0
    assert [k for k, _ in summary["fidelity"]["wave"]["worst_layers"]] == [3, 2, 1]
    settings = {"budget": 0.018, "sweep_length": 8000, "fidelity_length": 6000,
                "fidelity_queries": 16}
    payload = {"meta": environment("cpu", 1), "settings": settings, "summary": summary,
               "results": results, "fidelity": fidelity}
    paths = write(tmp_path, "acc", payload)
    assert [p.name for p in paths] == ["acc.json", "acc.md", "acc.png"]
    assert json.loads(paths[0].read_text())["summary"]["by_length"]["8000"]["wave"]["score"] == 0.75
    text = paths[1].read_text()
    assert "## 8000 tokens" in text and "## Budget sweep" in text and "| wave |" in text
    assert paths[2].stat().st_size > 10_000
