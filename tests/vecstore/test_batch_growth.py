"""A pinned batch's stacked view grows with its rows. Rows all equally long are shared: each
sequence's layer reads, and grows in place within the stack's reserve, its batch row of the
stack, so the batch holds one copy of its KV and the stack grows with nothing copied; a row
that moves out of the stack (its reserve full) has the stack rebuilt. A stack of its own
(a tier that does not share rows) is extended in place and only the rows added are copied.
Anything else (a rollback, padding) rebuilds it. The stack always equals one built afresh,
and the charges stay exact."""

from __future__ import annotations

import pytest
import torch

from tests.reference import rel_err
from vecstore import Store
from vecstore.engine.batch import BatchViews
from vecstore.errors import CapacityError
from vecstore.index.base import IndexView
from vecstore.kvstore import KVSTORES, PinnedKVStore

H, D = 2, 8
CFG = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
       "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 16},
       "kvstore": {"kind": "pinned"}}
UNSHARED = {**CFG, "kvstore": {"kind": "unshared_pinned"}}
MEMORY = {k: v for k, v in CFG.items() if k != "kvstore"}
PINNED, GPU = "kvstore.pinned_budget_gb", "kvstore.gpu_budget_gb on cpu"


class _Unshared(PinnedKVStore):
    """The pinned tier, its rows never shared: a batch's stack holds rows of its own."""

    shareable_rows = False


@pytest.fixture(params=["shared", "unshared"])
def config(request, register) -> dict:
    register(KVSTORES, "unshared_pinned", _Unshared)
    return CFG if request.param == "shared" else UNSHARED


@pytest.fixture
def unshared(register) -> dict:
    register(KVSTORES, "unshared_pinned", _Unshared)
    return UNSHARED


def _kv(B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def _q(B: int, seed: int) -> torch.Tensor:
    return torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(seed))


def _filled(B: int, n: int = 200, config: dict = CFG, *,
            apart: bool = False) -> tuple[Store, list]:
    """``B`` sequences of ``n`` tokens, appended as a batch (its rows placed as one stack
    where the tier shares rows) or, ``apart``, one by one (each in rows of its own)."""
    store = Store.open(config=config)
    seqs = [store.create(f"s{i}", num_layers=1, num_kv_heads=H, head_dim=D,
                         dtype=torch.float32) for i in range(B)]
    k, v = _kv(B, n, 0)
    if apart:
        for b, seq in enumerate(seqs):
            seq.append(0, k[b], v[b])
    else:
        store.append_batch(seqs, 0, k, v)
    return store, seqs


def _one_by_one(store: Store, seqs: list, q: torch.Tensor) -> torch.Tensor:
    return torch.cat([store.query([s], 0, q[b:b + 1]).out for b, s in enumerate(seqs)])


def _fresh(seqs: list) -> IndexView:
    return IndexView.stack([s.layers[0].view() for s in seqs])


def _assert_same(got: IndexView, want: IndexView) -> None:
    for a, b in ((got.keys, want.keys), (got.values, want.values),
                 (got.offsets, want.offsets), (got.sizes, want.sizes),
                 (got.num_units, want.num_units)):
        assert a.shape == b.shape and torch.equal(a, b)
    assert got.meta.keys() == want.meta.keys()
    assert all(torch.equal(got.meta[k], want.meta[k]) for k in got.meta)


def _stack_bytes(view: IndexView) -> tuple[int, int]:
    """Rows and index-metadata bytes of a stacked view."""
    rows = 2 * view.keys.numel() * view.keys.element_size()
    meta = view.offsets.nbytes + view.sizes.nbytes + sum(t.nbytes for t in view.meta.values())
    return rows, meta


def _layer_bytes(seqs: list) -> tuple[int, int]:
    """Rows and index-metadata bytes the sequences' layers hold."""
    images = [s.layers[0]._image for s in seqs]
    return sum(i.rows.num_bytes for i in images), sum(i.meta_bytes for i in images)


def _stacked(store: Store) -> IndexView:
    return store._queries._batch_views._cache[0].view


def test_a_decoding_pinned_batch_grows_its_stack_in_place_with_the_same_answers(config):
    store, seqs = _filled(3, config=config)
    ref, ref_seqs = _filled(3, config=MEMORY)
    store.query(seqs, 0, _q(3, 0))
    first = _stacked(store)
    ptr, sizes = first.keys.data_ptr(), {first.keys.shape[2]}
    shared = config is CFG
    for step in range(40):  # the tails index a segment every 16 steps
        k, v = _kv(3, 1, 100 + step)
        store.append_batch(seqs, 0, k, v)
        ref.append_batch(ref_seqs, 0, k, v)
        q = _q(3, step)
        got = store.query(seqs, 0, q).out
        assert rel_err(got, _one_by_one(ref, ref_seqs, q)) < 1e-5
        view = _stacked(store)
        _assert_same(view, _fresh(seqs))
        # grown in the reserve the tier made for the stack: never moved, never rebuilt
        assert view.keys.data_ptr() == ptr and view.values.stride() == first.values.stride()
        sizes.add(view.keys.shape[2])
        rows, meta = _layer_bytes(seqs)
        stack_rows, stack_meta = _stack_bytes(view)
        # shared: one copy, the layers' rows are the stack's batch rows
        assert store.memory()[PINNED][0] == rows + (0 if shared else stack_rows)
        assert store.memory()[GPU][0] == meta + stack_meta
        assert shared == all(
            s.layers[0].rows.keys.data_ptr() == view.keys[b].data_ptr()
            and s.layers[0].rows.values.data_ptr() == view.values[b].data_ptr()
            for b, s in enumerate(seqs))
    assert len(sizes) == 3  # two segments indexed: grown twice
    store.close()
    ref.close()
    assert store.placement.usage()[PINNED][0] == store.placement.usage()[GPU][0] == 0


def test_growth_copies_only_the_rows_added_and_retires_the_old_view(unshared):
    store, seqs = _filled(3, config=unshared)
    views = BatchViews(store.placement)
    old = views.view(seqs, 0)
    assert old is not None
    n_old = old.keys.shape[2]
    old.keys.fill_(7.0)  # a sentinel in the stack's copy: kept if its rows are not copied
    store.append_batch(seqs, 0, *_kv(3, 20, 1))  # one more segment each
    grown = views.view(seqs, 0)
    assert grown is not None and grown is not old
    assert grown.keys.data_ptr() == old.keys.data_ptr() and grown.keys.shape[2] > n_old
    assert bool((grown.keys[:, :, :n_old] == 7.0).all())
    want = _fresh(seqs)
    assert torch.equal(grown.keys[:, :, n_old:], want.keys[:, :, n_old:])
    assert torch.equal(grown.values, want.values)
    assert views.turnover.take() == ([old], [(old, grown)])
    views.clear()
    assert views.turnover.take() == ([grown], [])
    rows, meta = _layer_bytes(seqs)
    assert store.memory()[PINNED][0] == rows and store.memory()[GPU][0] == meta
    store.close()


def test_a_growth_that_fails_after_the_tier_grew_its_rows_keeps_the_charges_exact(
        monkeypatch, config):
    store, seqs = _filled(3, config=config)
    views = BatchViews(store.placement)
    views.view(seqs, 0)
    store.append_batch(seqs, 0, *_kv(3, 20, 1))

    def fail(*args: object) -> None:
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(IndexView, "stack", staticmethod(fail))
        with pytest.raises(RuntimeError, match="boom"):
            views.view(seqs, 0)
    _assert_same(views.view(seqs, 0), _fresh(seqs))  # rebuilt from scratch
    views.clear()
    rows, meta = _layer_bytes(seqs)
    assert store.memory()[PINNED][0] == rows and store.memory()[GPU][0] == meta
    store.close()


def test_a_rolled_back_layer_rebuilds_the_stack_over_its_new_rows(config):
    store, seqs = _filled(3, config=config)
    views = BatchViews(store.placement)
    views.view(seqs, 0)
    marks = [s.layers[0].mark() for s in seqs]
    store.append_batch(seqs, 0, *_kv(3, 20, 1))
    grown = views.view(seqs, 0)
    # back to the marks, then as many other tokens: as many segments and rows as the
    # grown stack holds, with other contents
    for s, mark in zip(seqs, marks, strict=True):
        s.layers[0].restore(mark)
    store.append_batch(seqs, 0, *_kv(3, 20, 2))
    assert grown is not None and grown.keys.shape == _fresh(seqs).keys.shape
    rebuilt = views.view(seqs, 0)
    assert rebuilt is not None
    _assert_same(rebuilt, _fresh(seqs))
    assert not torch.equal(rebuilt.keys, grown.keys)
    views.clear()
    rows, meta = _layer_bytes(seqs)
    assert store.memory()[PINNED][0] == rows and store.memory()[GPU][0] == meta
    store.close()


def test_a_rolled_back_append_answers_as_a_store_that_never_made_it(config):
    store, seqs = _filled(2, config=config)
    ref, ref_seqs = _filled(2)
    q = _q(2, 3)
    store.query(seqs, 0, q)
    with pytest.raises(RuntimeError, match="undo"), store.transaction():
        store.append_batch(seqs, 0, *_kv(2, 20, 1))
        store.query(seqs, 0, q)  # the stack grows inside the transaction
        raise RuntimeError("undo")
    store.append_batch(seqs, 0, *_kv(2, 20, 2))
    ref.append_batch(ref_seqs, 0, *_kv(2, 20, 2))
    assert rel_err(store.query(seqs, 0, q).out, _one_by_one(ref, ref_seqs, q)) < 1e-5
    _assert_same(_stacked(store), _fresh(seqs))
    store.close()
    ref.close()


def test_rows_of_other_lengths_are_padded_and_rebuilt_not_grown():
    store, seqs = _filled(2)
    seqs[0].append(0, *(x[0] for x in _kv(1, 20, 1)))  # s0 one segment longer
    q = _q(2, 4)
    store.query(seqs, 0, q)
    padded = _stacked(store)
    n = padded.keys.shape[2]
    assert seqs[1].layers[0].num_indexed < n
    seqs[1].append(0, *(x[0] for x in _kv(1, 20, 2)))  # equal again
    want = _one_by_one(store, seqs, q)
    assert rel_err(store.query(seqs, 0, q).out, want) < 1e-5
    _assert_same(_stacked(store), _fresh(seqs))
    store.close()


def test_a_stack_over_the_pinned_budget_raises_naming_it_and_changes_nothing():
    # rows appended one by one are not one stack: the batch's first query copies them
    probe, seqs = _filled(3, apart=True)
    rows, _ = _layer_bytes(seqs)
    probe.query(seqs, 0, _q(3, 5))
    stack_rows, _ = _stack_bytes(_stacked(probe))
    probe.close()
    tight = {**CFG, "kvstore": {"kind": "pinned",
                                "pinned_budget_gb": (rows + stack_rows - 1) / 2**30}}
    store, seqs = _filled(3, config=tight, apart=True)
    before = store.memory()
    with pytest.raises(CapacityError, match=f"{PINNED}: a stacked view of 3 sequences "
                                            rf"\(rows\) needs {stack_rows} more bytes"):
        BatchViews(store.placement).view(seqs, 0)
    assert store.memory() == before
    q = _q(3, 5)  # the store answers row by row instead
    assert torch.equal(store.query(seqs, 0, q).out, _one_by_one(store, seqs, q))
    assert store.memory() == before
    store.close()


def test_growth_that_does_not_fit_drops_the_stack_and_answers_row_by_row(unshared):
    def run(config: dict) -> tuple[Store, list, list[int]]:
        store, seqs = _filled(3, config=config)
        store.append_batch(seqs, 0, *_kv(3, 20, 1))  # the layers' rows move into reserves
        store.query(seqs, 0, _q(3, 6))  # the stack
        used = [store.memory()[PINNED][1]]
        store.append_batch(seqs, 0, *_kv(3, 16, 2))  # the layers grow in place
        used.append(store.memory()[PINNED][1])
        store.query(seqs, 0, _q(3, 7))  # the stack grows
        used.append(store.memory()[PINNED][0])
        return store, seqs, used

    probe, _, used = run(unshared)
    probe.close()
    budget = used[-1] - 1  # all but the stack's growth fits
    assert used[1] <= budget
    store, seqs, _ = run({**CFG, "kvstore": {"kind": "unshared_pinned",
                                             "pinned_budget_gb": budget / 2**30}})
    rows, meta = _layer_bytes(seqs)
    assert store.memory()[PINNED][0] == rows and store.memory()[GPU][0] == meta  # dropped
    q = _q(3, 8)
    assert torch.equal(store.query(seqs, 0, q).out, _one_by_one(store, seqs, q))
    store.close()
    assert store.placement.usage()[PINNED][0] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_shared_pinned_batch_decodes_through_growth_on_cuda_as_device_rows():
    heads, dim = 2, 32
    q = torch.randn(3, 4 * heads, 1, dim, generator=torch.Generator().manual_seed(9)).cuda()
    out = {}
    for kind in ("memory", "pinned"):
        cfg = {"kvstore": {"kind": kind}, "executor": {"kind": "wave", "device": "cuda"},
               "index": {"segment_tokens": 256},
               "attention": {"update_tokens": 64, "window_tokens": 32}}
        with Store.open(config=cfg) as store:
            seqs = [store.create(f"s{i}", num_layers=1, num_kv_heads=heads, head_dim=dim,
                                 dtype="float32") for i in range(3)]
            gen = torch.Generator().manual_seed(5)
            store.append_batch(seqs, 0, torch.randn(3, heads, 2000, dim, generator=gen),
                               torch.randn(3, heads, 2000, dim, generator=gen))
            outs = []
            for _ in range(150):  # two segments indexed
                k = torch.randn(3, heads, 1, dim, generator=gen)
                store.append_batch(seqs, 0, k, -k)
                outs.append(store.query(seqs, 0, q).out.cpu())
            if kind == "pinned":  # one copy: the layers grew their rows of the stack
                view = _stacked(store)
                assert view.keys.is_pinned() and view.keys.stride(0) > view.keys[0].numel()
                assert view.values[:, :, -1].is_pinned()
                _assert_same(view, _fresh(seqs))
                assert all(s.layers[0].rows.keys.data_ptr() == view.keys[b].data_ptr()
                           for b, s in enumerate(seqs))
                assert store.memory()[PINNED][0] == _layer_bytes(seqs)[0]
            out[kind] = torch.stack(outs)
    assert rel_err(out["pinned"], out["memory"]) < 1e-5
