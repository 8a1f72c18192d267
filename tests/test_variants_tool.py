"""The settings of benchmarks/variants.py: parsed strictly, applied and always restored."""

from __future__ import annotations

import pytest
import torch

from benchmarks.variants import applied, parse_setting, parse_size
from vecstore.kernels import radix_select


def test_settings_are_applied_for_the_block_and_restored_after():
    before = radix_select._KEPT
    settings = [parse_setting("vecstore.kernels.radix_select._KEPT=4")]
    assert settings == [(radix_select, "_KEPT", 4)]
    with applied(settings):
        assert radix_select._KEPT == 4
    assert radix_select._KEPT == before
    with pytest.raises(RuntimeError), applied(settings):
        raise RuntimeError("a variant failed to build")
    assert radix_select._KEPT == before


@pytest.mark.parametrize(("text", "match"), [
    ("radix_select._KEPT", "expected module.ATTR=value"),
    ("_KEPT=4", "expected module.ATTR=value"),
    ("vecstore.kernels.radix_select._NOPE=4", "has no attribute '_NOPE'"),
    ("vecstore.kernels.radix_select._KEPT=four", "is not a Python literal"),
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
