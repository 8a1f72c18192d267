"""Numba cluster gather: bit-exact against torch.index_select, and every input check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecstore.errors import InvalidValueError, ShapeError
from vecstore.executor.numba_gather import gather_clusters

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _random_store(num_heads: int, num_rows: int, dim: int, dtype: torch.dtype,
                  seed: int) -> torch.Tensor:
    """Random bit patterns, NaN payloads and signed zeros included: the copy must keep them."""
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(info.min, info.max, (num_heads, num_rows, dim), generator=g, dtype=bits)
    return raw.view(dtype)


def _reference(store: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> list:
    """Per head, the selected rows in order, via index_select on the integer view."""
    rows = []
    for h in range(store.shape[0]):
        index = [i for s, n in zip(starts[h].tolist(), lengths[h].tolist(), strict=True)
                 for i in range(s, s + n)]
        rows.append(torch.index_select(store[h].view(BITS[store.dtype]), 0,
                                       torch.tensor(index, dtype=torch.int64)))
    return rows


@st.composite
def problems(draw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_heads, num_rows = draw(st.integers(1, 4)), draw(st.integers(0, 40))
    dim, num_ranges = draw(st.integers(1, 6)), draw(st.integers(0, 5))
    dtype = draw(st.sampled_from(DTYPES))
    starts, lengths = [], []
    for _ in range(num_heads * num_ranges):
        start = draw(st.integers(0, num_rows))
        starts.append(start)
        lengths.append(draw(st.integers(0, num_rows - start)))
    shape = (num_heads, num_ranges)
    store = _random_store(num_heads, num_rows, dim, dtype, draw(st.integers(0, 2**16)))
    return (store, torch.tensor(starts, dtype=torch.int64).reshape(shape),
            torch.tensor(lengths, dtype=torch.int64).reshape(shape))


@settings(max_examples=60, deadline=None)
@given(problem=problems(), spare=st.integers(0, 3), room=st.integers(0, 2))
def test_matches_index_select_bit_exactly(problem: tuple, spare: int, room: int) -> None:
    store, starts, lengths = problem
    if room:  # heads further apart than their rows, as in a tier's reserve
        H, N, D = store.shape
        reserve = torch.full((H, N + room, D), 7, dtype=BITS[store.dtype]).view(store.dtype)
        reserve[:, :N] = store
        store = reserve[:, :N]
    want = _reference(store, starts, lengths)
    totals = [len(rows) for rows in want]
    got = gather_clusters(store, starts, lengths)
    assert got.out.shape == (store.shape[0], max(totals), store.shape[2])
    assert got.out.dtype == store.dtype and got.lengths.tolist() == totals
    # a caller's buffer, larger than needed: rows past each head's total stay untouched
    out = torch.full((store.shape[0], max(totals) + spare, store.shape[2]), -1,
                     dtype=BITS[store.dtype]).view(store.dtype)
    again = gather_clusters(store, starts, lengths, out=out)
    assert again.out is out and again.lengths.tolist() == totals
    for h, rows in enumerate(want):
        assert torch.equal(got.out[h, : totals[h]].view(BITS[store.dtype]), rows)
        assert torch.equal(out[h, : totals[h]].view(BITS[store.dtype]), rows)
        assert bool((out[h, totals[h]:].view(BITS[store.dtype]) == -1).all())


def test_non_contiguous_index_arrays_are_accepted() -> None:
    store = torch.arange(24, dtype=torch.float32).reshape(2, 6, 2)
    starts = torch.tensor([[0, 4], [1, 3]]).t()  # [R=2, Hkv=2] transposed to [Hkv, R]
    lengths = torch.tensor([[1, 2], [2, 1]]).t()
    got = gather_clusters(store, starts, lengths)
    assert got.lengths.tolist() == [3, 3]
    assert got.out[0, :, 0].tolist() == [0.0, 2.0, 4.0]
    assert got.out[1, :, 0].tolist() == [20.0, 22.0, 18.0]


def _args() -> dict[str, Any]:
    return {"store": torch.zeros(2, 10, 4, dtype=torch.bfloat16),
            "starts": torch.tensor([[0, 5], [2, 8]]),
            "lengths": torch.tensor([[3, 5], [1, 2]])}


BAD = [
    ("store", [[1.0]], ShapeError, "store: expected a torch.Tensor"),
    ("store", torch.zeros(10, 4), ShapeError, r"store: expected shape \(\*, \*, \*\)"),
    ("store", torch.zeros(2, 10, 4, dtype=torch.int16), ShapeError, "store: expected dtype"),
    ("store", torch.zeros(2, 4, 10).transpose(1, 2), ShapeError,
     r"KV rows must be \[rows, N, D\] with contiguous \[N, D\] blocks"),
    ("store", torch.zeros(2, 10, 4, device="meta"), ShapeError, "store: expected a CPU tensor"),
    ("starts", torch.tensor([[0, 5], [2, 8]], dtype=torch.int32), ShapeError, "starts: .*int64"),
    ("starts", torch.tensor([[0, 5]]), ShapeError, r"starts: expected shape \(2, \*\)"),
    ("starts", torch.tensor([[0, 5], [2, 8]], device="meta"), ShapeError, "starts: .*CPU"),
    ("lengths", torch.tensor([[3], [1]]), ShapeError, r"lengths: expected shape \(2, 2\)"),
    ("lengths", torch.tensor([[3., 5.], [1., 2.]]), ShapeError, "lengths: .*int64"),
    ("starts", torch.tensor([[0, 5], [-1, 8]]), InvalidValueError, r"starts\[1, 0\]: .* got -1"),
    ("lengths", torch.tensor([[3, -5], [1, 2]]), InvalidValueError, r"lengths\[0, 1\]: .*-5"),
    ("lengths", torch.tensor([[3, 6], [1, 2]]), InvalidValueError,
     r"starts\[0, 1\] \+ lengths\[0, 1\]: rows \[5, 11\) run past the store's 10 rows"),
    ("starts", torch.tensor([[0, 5], [2, 2**62]]), InvalidValueError, r"starts\[1, 1\]"),
    ("lengths", torch.tensor([[3, 5], [1, 2**63 - 1]]), InvalidValueError, r"lengths\[1, 1\]"),
    ("out", torch.zeros(2, 8, 4), ShapeError, "out: expected dtype"),
    ("out", torch.zeros(2, 8, 3, dtype=torch.bfloat16), ShapeError, r"out: expected shape"),
    ("out", torch.zeros(2, 4, 8, dtype=torch.bfloat16).transpose(1, 2), ShapeError,
     "out: expected a contiguous"),
    ("out", torch.zeros(2, 7, 4, dtype=torch.bfloat16), InvalidValueError,
     r"out: holds 7 rows per head, but head 0 gathers 8"),
]


@pytest.mark.parametrize("name, value, error, match", BAD, ids=[m for *_, m in BAD])
def test_bad_inputs(name: str, value: Any, error: type[Exception], match: str) -> None:
    args = _args()
    args[name] = value
    with pytest.raises(error, match=match):
        gather_clusters(**args)


def test_valid_arguments_of_the_error_cases_work() -> None:
    got = gather_clusters(**_args(), out=torch.zeros(2, 8, 4, dtype=torch.bfloat16))
    assert got.lengths.tolist() == [8, 3]
