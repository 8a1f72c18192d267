"""A batch query's stacked view becomes the rows of its sequences (one copy of the batch's
KV, not two): the answers, the stored data, the budgets and rollbacks stay as they were."""

from __future__ import annotations

import pytest
import torch

from vecstore import Store
from vecstore.config import StoreConfig

H, D = 2, 8
CFG = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
       "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 16}}


def _kv(B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def _q(B: int, seed: int) -> torch.Tensor:
    return torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(seed))


def _filled(lengths: list[int], config: dict = CFG, seed: int = 0) -> tuple[Store, list]:
    store = Store.open(config=config)
    seqs = [store.create(f"s{i}", num_layers=1, num_kv_heads=H, head_dim=D,
                         dtype=torch.float32) for i in range(len(lengths))]
    for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        k, v = _kv(1, n, seed + i)
        seq.append(0, k[0], v[0])
    return store, seqs


def _one_by_one(store: Store, seqs: list, q: torch.Tensor) -> torch.Tensor:
    return torch.cat([store.query([s], 0, q[b:b + 1]).out for b, s in enumerate(seqs)])


def _storage(seq) -> int:
    return seq.layers[0].rows.keys.untyped_storage().data_ptr()


def test_equal_rows_are_read_from_the_stack_with_the_same_answers():
    store, seqs = _filled([200, 200, 200])
    q = _q(3, 1)
    alone = _one_by_one(store, seqs, q)
    used = store.memory()["kvstore.gpu_budget_gb on cpu"][0]
    own = [_storage(s) for s in seqs]
    out = store.query(seqs, 0, q).out
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-6)
    shared = {_storage(s) for s in seqs}
    assert len(shared) == 1 and shared.isdisjoint(own)  # one allocation: the stack
    # the stack's rows were charged while both copies lived, then went with the sequences'
    # own charges; its index metadata (a copy) stays charged while the batch is cached
    now, peak, _ = store.memory()["kvstore.gpu_budget_gb on cpu"]
    views = [s.layers[0].view() for s in seqs]
    meta = sum(v.offsets.nbytes + v.sizes.nbytes + sum(t.nbytes for t in v.meta.values())
               for v in views)
    assert now == used + meta
    assert peak >= used + sum(v.keys.nbytes + v.values.nbytes for v in views)
    assert [s.layers[0].version for s in seqs] == [1, 1, 1]  # contents unchanged
    torch.testing.assert_close(_one_by_one(store, seqs, q), alone, rtol=0, atol=0)
    torch.testing.assert_close(store.query(seqs, 0, q).out, out, rtol=0, atol=0)
    store.close()


def test_growth_rollback_and_drop_after_sharing_match_a_store_never_batched():
    store, seqs = _filled([150, 150])
    ref, ref_seqs = _filled([150, 150])
    q = _q(2, 2)
    store.query(seqs, 0, q)  # shares
    k, v = _kv(2, 40, 9)  # enough to index new segments
    store.append_batch(seqs, 0, k, v)
    for b, s in enumerate(ref_seqs):
        s.append(0, k[b], v[b])
    torch.testing.assert_close(store.query(seqs, 0, q).out, _one_by_one(ref, ref_seqs, q),
                               rtol=1e-5, atol=1e-6)
    before = _one_by_one(store, seqs, q)
    with pytest.raises(RuntimeError, match="boom"), store.transaction():
        store.append_batch(seqs, 0, *_kv(2, 40, 10))
        raise RuntimeError("boom")
    torch.testing.assert_close(_one_by_one(store, seqs, q), before, rtol=0, atol=0)
    torch.testing.assert_close(store.query(seqs, 0, q).out, before, rtol=1e-5, atol=1e-6)
    store.drop("s0")
    torch.testing.assert_close(store.query([seqs[1]], 0, q[1:]).out, before[1:], rtol=0,
                               atol=0)
    assert store.memory()["kvstore.gpu_budget_gb on cpu"][0] == \
        seqs[1].layers[0].rows.num_bytes + seqs[1].layers[0]._image.meta_bytes
    store.close()
    ref.close()


def test_rows_of_other_lengths_keep_their_own_copy_and_equal_pinned_rows_share():
    store, seqs = _filled([200, 120, 200])
    q = _q(3, 3)
    alone = _one_by_one(store, seqs, q)
    short = _storage(seqs[1])
    own = [_storage(s) for s in seqs]
    torch.testing.assert_close(store.query(seqs, 0, q).out, alone, rtol=1e-5, atol=1e-6)
    # one row is padded in the stack: none is shared, so no row keeps an old stack alive
    assert [_storage(s) for s in seqs] == own and _storage(seqs[1]) == short
    store.close()
    pinned = StoreConfig.from_dict({**CFG, "kvstore": {"kind": "pinned"}}).to_dict()
    store, seqs = _filled([200, 200], pinned)
    own = [_storage(s) for s in seqs]
    q = _q(2, 4)
    alone = _one_by_one(store, seqs, q)
    torch.testing.assert_close(store.query(seqs, 0, q).out, alone, rtol=1e-5, atol=1e-6)
    shared = {_storage(s) for s in seqs}
    assert len(shared) == 1 and shared.isdisjoint(own)  # the stack's reserve
    rows = sum(s.layers[0].rows.num_bytes for s in seqs)
    assert store.memory()["kvstore.pinned_budget_gb"][0] == rows
    torch.testing.assert_close(_one_by_one(store, seqs, q), alone, rtol=0, atol=0)
    store.close()
    assert store.memory()["kvstore.pinned_budget_gb"][0] == 0


@pytest.mark.parametrize("kind", ["memory", "pinned"])
def test_rows_that_grow_apart_after_sharing_answer_as_a_store_never_batched(kind: str):
    store, seqs = _filled([150, 150, 150], {**CFG, "kvstore": {"kind": kind}})
    ref, ref_seqs = _filled([150, 150, 150])
    q = _q(3, 5)
    store.query(seqs, 0, q)  # all share one stack
    for i, grow in enumerate([(0,), (1, 2), (0, 1, 2)]):
        for b in grow:  # one or more rows index new segments: lengths part, then meet
            k, v = _kv(1, 40, 20 + 3 * i + b)
            seqs[b].append(0, k[0], v[0])
            ref_seqs[b].append(0, k[0], v[0])
        torch.testing.assert_close(store.query(seqs, 0, q).out,
                                   _one_by_one(ref, ref_seqs, q), rtol=1e-5, atol=1e-6)
    shared = {_storage(s) for s in seqs}
    assert len(shared) == 1  # equal again: shared again, the older stacks let go
    store.close()
    ref.close()
    assert all(used == 0 for used, _, _ in store.memory().values())
