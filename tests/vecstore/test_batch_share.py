"""A pinned batch whose rows are all equally long holds one copy of its KV: each sequence's
layer reads, and grows in place within the stack's reserve, its batch row of the stack, so
the stack grows with nothing copied and no page range registered twice; a row that
outgrows the reserve moves out and the stack is rebuilt; rollbacks, drops and closing keep
the answers those of a store never batched and the charges exact."""

from __future__ import annotations

import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import rel_err
from tests.vecstore.test_batch_growth import (
    CFG as PINNED_CFG,
)
from tests.vecstore.test_batch_growth import (
    GPU,
    MEMORY,
    PINNED,
    _assert_same,
    _filled,
    _fresh,
    _kv,
    _layer_bytes,
    _one_by_one,
    _q,
    _stacked,
)
from vecstore import Store
from vecstore.errors import CapacityError
from vecstore.kvstore.host_pages import HostPages


def _decode(store: Store, seqs: list, ref: Store, ref_seqs: list, steps: range,
            tokens: int = 1) -> None:
    """Append ``tokens`` to every row and query the batch, ``len(steps)`` times, checking
    the answers against ``ref`` (never batched) and that one copy of the rows is held."""
    B = len(seqs)
    for step in steps:
        k, v = _kv(B, tokens, 100 + step)
        store.append_batch(seqs, 0, k, v)
        ref.append_batch(ref_seqs, 0, k, v)
        q = _q(B, step)
        assert rel_err(store.query(seqs, 0, q).out, _one_by_one(ref, ref_seqs, q)) < 1e-5
        _assert_same(_stacked(store), _fresh(seqs))
        assert store.memory()[PINNED][0] == _layer_bytes(seqs)[0]


def test_growth_of_a_shared_stack_maps_nothing_and_registers_no_range_twice(monkeypatch):
    asked: list[tuple[HostPages, int, int]] = []
    maps: list[int] = []
    pin, map_ = HostPages.pin, HostPages.map

    def record_pin(pages: HostPages, offset: int, num_bytes: int, *, fault: bool = True) -> None:
        asked.append((pages, offset, num_bytes))
        pin(pages, offset, num_bytes, fault=fault)

    def record_map(num_bytes: int, *, register: bool,
                   dtype: torch.dtype = torch.uint8) -> tuple[HostPages, torch.Tensor]:
        maps.append(num_bytes)
        return map_(num_bytes, register=register, dtype=dtype)

    monkeypatch.setattr(HostPages, "pin", record_pin)
    monkeypatch.setattr(HostPages, "map", staticmethod(record_map))
    store, seqs = _filled(3)
    ref, ref_seqs = _filled(3, config=MEMORY)
    store.query(seqs, 0, _q(3, 0))
    stack = _stacked(store)
    built = len(maps)
    _decode(store, seqs, ref, ref_seqs, range(40))  # two segments indexed
    view = _stacked(store)
    assert view.keys.shape[2] > stack.keys.shape[2] and view.keys.data_ptr() == \
        stack.keys.data_ptr()
    assert len(maps) == built  # no row moved, no stack built: nothing copied
    for pages in {id(p): p for p, _, _ in asked}.values():  # whole pages, none twice
        ranges = sorted((o, o + n) for p, o, n in asked if p is pages)
        assert all(o % mmap.PAGESIZE == 0 == n % mmap.PAGESIZE for o, n in ranges)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    store.close()
    ref.close()
    assert store.memory()[PINNED][0] == 0


def test_shared_rows_that_outgrow_the_reserve_move_out_and_the_stack_is_rebuilt(
        monkeypatch):
    monkeypatch.setattr("vecstore.kvstore.pinned._RESERVE", 1)  # room for a page more
    store, seqs = _filled(3, apart=True)  # the first query stacks (and shares) them
    ref, ref_seqs = _filled(3, config=MEMORY)
    store.query(seqs, 0, _q(3, 0))
    ptrs = {_stacked(store).keys.data_ptr()}
    for i in range(6):  # every append indexes two segments; a page holds 128 rows
        _decode(store, seqs, ref, ref_seqs, range(10 * i, 10 * i + 1), tokens=40)
        ptrs.add(_stacked(store).keys.data_ptr())
        view = _stacked(store)
        assert all(s.layers[0].rows.keys.data_ptr() == view.keys[b].data_ptr()
                   for b, s in enumerate(seqs))  # shared again after every rebuild
    assert len(ptrs) > 2  # moved out and rebuilt more than once
    store.close()
    ref.close()
    assert store.placement.usage()[PINNED][0] == store.placement.usage()[GPU][0] == 0


def test_rollback_drop_and_close_of_a_shared_batch_keep_answers_and_charges_exact():
    store, seqs = _filled(3)
    ref, ref_seqs = _filled(3, config=MEMORY)
    _decode(store, seqs, ref, ref_seqs, range(20))  # shared, grown once
    with pytest.raises(RuntimeError, match="undo"), store.transaction():
        store.append_batch(seqs, 0, *_kv(3, 40, 1))
        store.query(seqs, 0, _q(3, 1))  # the rows grow in place in the stack
        raise RuntimeError("undo")
    assert store.memory()[PINNED][0] == _layer_bytes(seqs)[0]
    _decode(store, seqs, ref, ref_seqs, range(20, 40))
    store.drop("s0")
    ref.drop("s0")
    assert store.memory()[PINNED][0] == _layer_bytes(seqs[1:])[0]
    _decode(store, seqs[1:], ref, ref_seqs[1:], range(40, 60))
    q = _q(2, 9)
    assert rel_err(_one_by_one(store, seqs[1:], q), _one_by_one(ref, ref_seqs[1:], q)) < 1e-5
    store.close()
    ref.close()
    assert store.placement.usage()[PINNED][0] == store.placement.usage()[GPU][0] == 0


def test_a_batch_placed_together_is_its_stack_so_its_first_query_copies_nothing(monkeypatch):
    maps: list[int] = []
    map_ = HostPages.map

    def record_map(num_bytes: int, *, register: bool,
                   dtype: torch.dtype = torch.uint8) -> tuple[HostPages, torch.Tensor]:
        maps.append(num_bytes)
        return map_(num_bytes, register=register, dtype=dtype)

    monkeypatch.setattr(HostPages, "map", staticmethod(record_map))
    probe, probe_seqs = _filled(3)
    rows = _layer_bytes(probe_seqs)[0]
    probe.close()
    maps.clear()
    # no room for a second copy of the rows: the batch's own rows are its stack
    store, seqs = _filled(3, config={**PINNED_CFG, "kvstore": {
        "kind": "pinned", "pinned_budget_gb": rows / 2**30}})
    ref, ref_seqs = _filled(3, config=MEMORY)
    assert len(maps) == 2  # one stack's keys and values for the three sequences
    step = seqs[1].layers[0].rows.keys.data_ptr() - seqs[0].layers[0].rows.keys.data_ptr()
    assert step > 0 and all(  # batch rows of one stack, evenly spaced
        s.layers[0].rows.keys.data_ptr() == seqs[0].layers[0].rows.keys.data_ptr() + b * step
        for b, s in enumerate(seqs))
    q = _q(3, 0)
    assert rel_err(store.query(seqs, 0, q).out, _one_by_one(ref, ref_seqs, q)) < 1e-5
    view = _stacked(store)
    assert len(maps) == 2 and store.memory()[PINNED][0] == rows  # nothing copied
    assert all(view.keys[b].data_ptr() == s.layers[0].rows.keys.data_ptr()
               and view.values[b].data_ptr() == s.layers[0].rows.values.data_ptr()
               for b, s in enumerate(seqs))
    _assert_same(view, _fresh(seqs))
    store.close()
    ref.close()
    assert store.placement.usage()[PINNED][0] == 0


def test_a_first_placement_that_fails_returns_the_whole_stack():
    probe, seqs = _filled(3)
    rows, meta = _layer_bytes(seqs)  # of the three layers
    meta //= 3  # one layer's index metadata
    probe.close()
    # the second layer's metadata does not fit: the first layer took its batch row
    config = {**PINNED_CFG, "kvstore": {"kind": "pinned",
                                        "gpu_budget_gb": (2 * meta - 1) / 2**30}}
    store = Store.open(config=config)
    seqs = [store.create(f"s{i}", num_layers=1, num_kv_heads=2, head_dim=8,
                         dtype=torch.float32) for i in range(3)]
    with pytest.raises(CapacityError, match=GPU):
        store.append_batch(seqs, 0, *_kv(3, 200, 0))
    assert [s.num_tokens for s in seqs] == [0, 0, 0]
    # the rows no layer took are returned at once; the first layer's, rolled back, when
    # it is next placed (as any rolled-back layer's)
    assert store.memory()[PINNED][0] == rows // 3 and store.memory()[GPU][0] == meta
    assert all(s.layers[0].view() is None for s in seqs)
    assert store.memory()[PINNED][0] == store.memory()[GPU][0] == 0
    store.close()


@settings(max_examples=15, deadline=None)
@given(B=st.integers(2, 4), chunks=st.lists(st.integers(2, 40), min_size=1, max_size=6),
       steps=st.integers(0, 20), kind=st.sampled_from(["pinned", "memory"]))
def test_batches_prefilled_together_answer_as_a_store_never_batched(B, chunks, steps, kind):
    # prefill chunks appended together (the first placement one stack), then decode steps
    # (the stack grows or is rebuilt), every answer that of rows queried one by one, the
    # batch's rows held once
    config = {**PINNED_CFG, "kvstore": {"kind": kind}}
    store = Store.open(config=config)
    ref = Store.open(config=MEMORY)
    seqs, ref_seqs = ([s.create(f"s{i}", num_layers=1, num_kv_heads=2, head_dim=8,
                                dtype=torch.float32) for i in range(B)] for s in (store, ref))
    for i, n in enumerate(chunks):
        k, v = _kv(B, n, i)
        store.append_batch(seqs, 0, k, v, whole_segments=True)
        ref.append_batch(ref_seqs, 0, k, v, whole_segments=True)
    for i in range(steps + 1):
        q = _q(B, i)
        assert rel_err(store.query(seqs, 0, q).out, _one_by_one(ref, ref_seqs, q)) < 1e-5
        if kind == "pinned" and seqs[0].layers[0].rows is not None:
            assert store.memory()[PINNED][0] == _layer_bytes(seqs)[0]  # one copy
        store.append_batch(seqs, 0, *_kv(B, 1, 100 + i))
        ref.append_batch(ref_seqs, 0, *_kv(B, 1, 100 + i))
    store.close()
    ref.close()
    assert all(used == 0 for used, _, _ in store.placement.usage().values())
