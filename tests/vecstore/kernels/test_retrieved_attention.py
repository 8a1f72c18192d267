"""attend_retrieved and fill_rowmap against the float64 reference: exact attention over the
rows of the retrieved clusters, read in place through the row map or from an execution
buffer (whole, or its hits and misses apart)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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
from vecstore.kernels import retrieved_attention
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


def _uneven_case(sizes: list[list[int]], picked: list[list[int]], group: int, dim: int,
                 gen: torch.Generator):
    # rows of the given cluster sizes (0: empty, never retrieved), placed along the KV rows
    # in a random cluster order (first_row not rising with the cluster id), every KV row
    # outside the picked clusters NaN; the zones past each row's count hold garbage that
    # would show if read: cum entries below every position, first rows at the last KV row
    # (in no cluster: NaN)
    rows, num_clusters = len(sizes), max(1, *(len(s) for s in sizes))
    size = torch.zeros(rows, num_clusters, dtype=torch.int32)
    first = torch.zeros(rows, num_clusters, dtype=torch.int32)
    for r, row_sizes in enumerate(sizes):
        size[r, :len(row_sizes)] = torch.tensor(row_sizes, dtype=torch.int32)
        order = torch.randperm(num_clusters, generator=gen)
        first[r, order] = (torch.cumsum(size[r, order], 0) - size[r, order]).int()
    num_rows = int(size.sum(1).max()) + 1
    r_max = max(len(p) for p in picked) + 3
    zones = make_zones(size, first, picked, [[] for _ in range(rows)], r_max, 1)
    for r, ids in enumerate(picked):
        zones.cum[r, len(ids) + 1:] = -5
        zones.first_row[r, len(ids):] = num_rows - 1
    valid = torch.zeros(rows, num_rows, dtype=torch.bool)
    for r, ids in enumerate(picked):
        for c in ids:
            valid[r, first[r, c]:first[r, c] + size[r, c]] = True
    keys = torch.randn(rows, num_rows, dim, generator=gen)
    values = torch.randn(rows, num_rows, dim, generator=gen)
    keys[~valid], values[~valid] = float("nan"), float("nan")
    q = torch.randn(rows * group, dim, generator=gen)
    return q, keys, values, zones, valid


def _check_uneven(monkeypatch, sizes, picked, split_rows, group, gen, device="cpu"):
    # the row map and attention in place against the reference, RETRIEVED_SPLIT =
    # split_rows: small splits start mid-cluster, large ones span many clusters
    monkeypatch.setattr(retrieved_attention, "RETRIEVED_SPLIT", split_rows)
    device, dim = torch.device(device), 16
    q, keys, values, zones, valid = _uneven_case(sizes, picked, group, dim, gen)
    max_rows = int(valid.sum(1).max()) + 3
    z = on(zones, device)
    rowmap = torch.empty(len(sizes), max_rows, dtype=torch.int32, device=device)
    fill_rowmap(z, rowmap)
    splits = retrieved_layout(max_rows)[1]
    parts = empty_parts(q.shape[0], splits, dim, device)
    attend_retrieved(q.to(device), keys.to(device), values.to(device), z, rowmap,
                     dim ** -0.5, parts, 0)
    assert_state_close(*merged_parts(parts, 0, splits),
                       *_reference(q, keys, values, valid, group),
                       tolerance(torch.float32, device))


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


_BLOCK = retrieved_attention._BLOCK_N
# row 0: clusters of 1 row, of more than a block, of exactly a block, empty ones between;
# row 1: 140 clusters of one row retrieved, empty ones between, the larger ones after them
# not retrieved; row 2: nothing retrieved; row 3: some clusters left out, one of over two
# blocks
_UNEVEN_SIZES = [
    [1, 150, 0, 1, 0, 3, 70, 1, 1, 2, _BLOCK, 0, 5, _BLOCK + 1],
    [1 if k % 3 else 0 for k in range(200)] + [4, 9],
    [5, 1, 7],
    [_BLOCK - 1, 2, 0, _BLOCK + 1, 1, 30, 1, 0, 2 * _BLOCK + 3, 1],
]
_UNEVEN_PICKED = [
    [c for c, n in enumerate(_UNEVEN_SIZES[0]) if n],
    [c for c, n in enumerate(_UNEVEN_SIZES[1]) if n][:140],
    [],
    [0, 1, 3, 4, 6, 8],
]


@pytest.mark.parametrize("split_rows", [_BLOCK, 2 * _BLOCK, 512])
@interpreted
def test_in_place_reads_uneven_clusters(monkeypatch, gen, split_rows):
    _check_uneven(monkeypatch, _UNEVEN_SIZES, _UNEVEN_PICKED, split_rows, 2, gen)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
@interpreted
def test_in_place_reads_any_cluster_sizes(data):
    # any sizes (mostly tiny, now and then over a block), any non-empty clusters retrieved,
    # rows of different counts (0 included), splits of one block up to the default
    rows = data.draw(st.integers(1, 3))
    one = st.one_of(st.sampled_from([0, 0, 1, 1, 1, 2, 3]),
                    st.integers(_BLOCK - 2, 2 * _BLOCK + 2))
    sizes = [data.draw(st.lists(one, min_size=1, max_size=60)) for _ in range(rows)]
    picked = [[c for c, n in enumerate(s) if n and data.draw(st.booleans())] for s in sizes]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    with pytest.MonkeyPatch.context() as monkeypatch:
        _check_uneven(monkeypatch, sizes, picked, data.draw(st.sampled_from([_BLOCK, 128, 512])),
                      data.draw(st.sampled_from([1, 3])), gen)


@pytest.mark.gpu
@pytest.mark.parametrize("split_rows", [_BLOCK, 512])
def test_gpu_in_place_uneven_clusters(monkeypatch, gen, split_rows):
    _check_uneven(monkeypatch, _UNEVEN_SIZES, _UNEVEN_PICKED, split_rows, 4, gen, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_in_place_llama_shape(gen, dtype):
    _check_in_place(torch.device("cuda"), 16, 4, 128, 4096, 120, dtype, gen)


@pytest.mark.gpu
def test_gpu_execution_buffer_llama_shape(gen):
    _check_execution_buffer(torch.device("cuda"), 16, 4, 128, 4096, 120, torch.bfloat16, gen)
