"""The settings of benchmarks/variants.py: parsed strictly, applied and always restored."""

from __future__ import annotations

import pytest
import torch

from benchmarks.variants import applied, parse_setting, parse_size
from vecstore.executor import wave_radix


def test_settings_are_applied_for_the_block_and_restored_after():
    before = wave_radix._KEPT
    settings = [parse_setting("vecstore.executor.wave_radix._KEPT=4")]
    assert settings == [(wave_radix, "_KEPT", 4)]
    with applied(settings):
        assert wave_radix._KEPT == 4
    assert wave_radix._KEPT == before
    with pytest.raises(RuntimeError), applied(settings):
        raise RuntimeError("a variant failed to build")
    assert wave_radix._KEPT == before


@pytest.mark.parametrize(("text", "match"), [
    ("wave_radix._KEPT", "expected module.ATTR=value"),
    ("_KEPT=4", "expected module.ATTR=value"),
    ("vecstore.executor.wave_radix._NOPE=4", "has no attribute '_NOPE'"),
    ("vecstore.executor.wave_radix._KEPT=four", "is not a Python literal"),
])
def test_bad_settings_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_setting(text)


def test_sizes():
    assert parse_size("8x131072") == (8, 131072)
    with pytest.raises(ValueError, match="BATCHxCONTEXT"):
        parse_size("8-131072")


def test_executor_settings_become_executor_arguments():
    from benchmarks.variants import EXECUTOR

    setting = parse_setting("executor.score_dtype='bfloat16'")
    assert setting[:2] == (EXECUTOR, "score_dtype")
    assert EXECUTOR.kwargs() == {}  # unset: the executor's own default
    with applied([setting]):
        assert EXECUTOR.kwargs() == {"score_dtype": torch.bfloat16}
    assert EXECUTOR.kwargs() == {}
