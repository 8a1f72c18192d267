"""The documentation builds strictly and covers every configuration key."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vecstore.config import LayerOverride, StoreConfig

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_covers_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text()
    cfg = StoreConfig()
    for section in dataclasses.fields(cfg):
        if section.name == "layers":
            continue
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f"`{section.name}.{f.name}`" in text, f"{section.name}.{f.name}"
    for f in dataclasses.fields(LayerOverride):
        assert f"`layers.N.{f.name}`" in text, f.name


def test_mkdocs_build_strict(tmp_path):
    if shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists():
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
