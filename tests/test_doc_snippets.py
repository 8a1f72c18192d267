"""Every Python example of the README and of docs/*.md runs as written, without a
deprecation warning (transformers' included).

The examples of one page run in order in one namespace, in an empty working directory.
Pages about the transformers integration speak of "a loaded ``model``": they get a tiny
random Llama as ``model`` (and its ``input_ids``, ``attention_mask``,
``doc_ids``, ``question_ids``), the only names given to any page.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch

from tests.integrations.hf_models import left_padded, tiny_model

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_DEPRECATED = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def _blocks(page: Path) -> list[str]:
    return _BLOCK.findall(page.read_text())


def _namespace(text: str) -> dict[str, object]:
    if "model" not in text:
        return {}
    ids, mask = left_padded([40, 56], seed=11)
    return {"model": tiny_model(), "input_ids": ids,
            "attention_mask": mask, "doc_ids": ids[1:, :40], "question_ids": ids[1:, 40:]}


class _Deprecations(logging.Handler):
    """transformers also announces deprecations through its loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "deprecat" in record.getMessage().lower():
            self.seen.append(record.getMessage())


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_examples_run_without_deprecation_warnings(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks(page)
    namespace = _namespace("\n".join(blocks))
    handler = _Deprecations()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            for category in _DEPRECATED:
                warnings.simplefilter("error", category)
            for i, block in enumerate(blocks):
                code = compile(block, f"{page.name}, example {i + 1}", "exec")
                exec(code, namespace)  # noqa: S102 - the documentation's own examples
    finally:
        logger.removeHandler(handler)
    assert handler.seen == []


def test_the_readme_names_the_docs_extra_where_it_mentions_mkdocs():
    for page in PAGES:
        for line_no, line in enumerate(page.read_text().splitlines(), 1):
            if "mkdocs serve" in line or "mkdocs build" in line:
                context = "\n".join(page.read_text().splitlines()[max(0, line_no - 3):line_no])
                assert ".[docs]" in context, f"{page.name}:{line_no}"
