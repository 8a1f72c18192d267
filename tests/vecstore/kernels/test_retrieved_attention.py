"""attend_retrieved and fill_rowmap against the float64 reference: exact attention over the
rows of the retrieved clusters, read in place through the row map or from an execution
buffer (whole, or its hits and misses apart)."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import (
    DTYPES,
    assert_state_close,
    clustered,
    empty_parts,
    make_zones,
    merged_parts,
    on,
    tolerance,
)

from tests.interpreter import interpreted
from vecstore.kernels.reference import attend
from vecstore.kernels.retrieved_attention import attend_retrieved, fill_rowmap, retrieved_layout


def _case(rows: int, group: int, dim: int, num_clusters: int, picks: int, dtype: torch.dtype,
          gen: torch.Generator):
    sizes, first = clustered(rows, num_clusters, 12, gen)
    num_rows = int(sizes.sum(1).max())
    keys = torch.randn(rows, num_rows, dim, generator=gen).to(dtype)
    values = torch.randn(rows, num_rows, dim, generator=gen).to(dtype)
    q = torch.randn(rows * group, dim, generator=gen).to(dtype)
    picked = [torch.randperm(num_clusters, generator=gen)[:picks].tolist() for _ in range(rows)]
    picked[-1] = []  # a row that retrieves nothing: an empty state
    zones = make_zones(sizes, first, picked, [[] for _ in range(rows)], max(1, picks), 1)
    valid = torch.zeros(rows, num_rows, dtype=torch.bool)
    for r, ids in enumerate(picked):
        for c in ids:
            valid[r, first[r, c]:first[r, c] + sizes[r, c]] = True
    keys[~valid] = float("nan")  # rows of clusters not retrieved are never read
    values[~valid] = float("nan")
    return q, keys, values, zones, valid


def _reference(q, keys, values, valid, group):
    rows, _, dim = keys.shape
    return attend(q.double().view(rows, 1, group, 1, dim), keys.double().nan_to_num()[:, None],
                  values.double().nan_to_num()[:, None], valid[:, None], dim ** -0.5)


def _check_in_place(device, rows, group, dim, num_clusters, picks, dtype, gen):
    q, keys, values, zones, valid = _case(rows, group, dim, num_clusters, picks, dtype, gen)
    max_rows = int(zones.cum[torch.arange(rows), zones.count.long()].max()) + 5
    rowmap = torch.full((rows, max_rows), -7, dtype=torch.int32, device=device)
    z = on(zones, device)
    fill_rowmap(z, rowmap)
    for r in range(rows):  # position cum[i] + j holds KV row first_row[i] + j
        total = int(zones.cum[r, zones.count[r]])
        assert sorted(rowmap[r, :total].tolist()) == valid[r].nonzero().flatten().tolist()
        assert (rowmap[r, total:] == -7).all()  # positions past the total are left alone
    splits = retrieved_layout(max_rows)[1]
    parts = empty_parts(q.shape[0], splits, dim, device)
    attend_retrieved(q.to(device), keys.to(device), values.to(device), z, rowmap, dim ** -0.5,
                     parts, 0)
    out, lse = merged_parts(parts, 0, splits)
    assert_state_close(out, lse, *_reference(q, keys, values, valid, group),
                       tolerance(dtype, device))


def _check_execution_buffer(device, rows, group, dim, num_clusters, picks, dtype, gen):
    # the execution buffer holds each row's retrieved rows back to back: hits, then misses
    q, keys, values, zones, valid = _case(rows, group, dim, num_clusters, picks, dtype, gen)
    exec_rows = int(valid.sum(1).max()) + 3
    exec_k = torch.full((rows, exec_rows, dim), float("nan"), dtype=dtype)
    exec_v = torch.full((rows, exec_rows, dim), float("nan"), dtype=dtype)
    for r in range(rows):
        n = int(valid[r].sum())
        exec_k[r, :n], exec_v[r, :n] = keys[r, valid[r]], values[r, valid[r]]
    split = (valid.sum(1) // 3).int()  # the first third of each row's rows are hits
    z, splits = on(zones, device), retrieved_layout(exec_rows)[1]
    args = (q.to(device), exec_k.to(device), exec_v.to(device), z, None, dim ** -0.5)
    whole = empty_parts(q.shape[0], splits, dim, device)
    attend_retrieved(*args, whole, 0)
    halves = empty_parts(q.shape[0], 2 * splits, dim, device)
    attend_retrieved(*args, halves, 0, split=split.to(device))
    attend_retrieved(*args, halves, splits, split=split.to(device), after_split=True)
    ref = _reference(q, keys, values, valid, group)
    assert_state_close(*merged_parts(whole, 0, splits), *ref, tolerance(dtype, device))
    assert_state_close(*merged_parts(halves, 0, 2 * splits), *ref, tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@interpreted
def test_in_place_matches_reference(gen, dtype):
    _check_in_place(torch.device("cpu"), 3, 3, 64, 60, 9, dtype, gen)


@interpreted
def test_execution_buffer_matches_reference(gen):
    _check_execution_buffer(torch.device("cpu"), 3, 4, 32, 60, 9, torch.bfloat16, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_in_place_llama_shape(gen, dtype):
    _check_in_place(torch.device("cuda"), 16, 4, 128, 4096, 120, dtype, gen)


@pytest.mark.gpu
def test_gpu_execution_buffer_llama_shape(gen):
    _check_execution_buffer(torch.device("cuda"), 16, 4, 128, 4096, 120, torch.bfloat16, gen)
