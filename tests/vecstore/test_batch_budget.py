"""A batch query's stacked view is charged to the budgets while it is cached, and a stack
that does not fit makes the batch read each row's own view instead (never an error, never
over budget)."""

from __future__ import annotations

import pytest
import torch

from vecstore import Store
from vecstore.config import StoreConfig
from vecstore.index.base import IndexView

H, D = 2, 8
CFG = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
       "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 16}}
GPU = "kvstore.gpu_budget_gb on cpu"


def _filled(lengths: list[int], config: dict = CFG) -> tuple[Store, list]:
    store = Store.open(config=config)
    seqs = [store.create(f"s{i}", num_layers=1, num_kv_heads=H, head_dim=D,
                         dtype=torch.float32) for i in range(len(lengths))]
    g = torch.Generator().manual_seed(0)
    for seq, n in zip(seqs, lengths, strict=True):
        seq.append(0, torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g))
    return store, seqs


def _q(B: int) -> torch.Tensor:
    return torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(1))


def _stack_bytes(views: list[IndexView]) -> tuple[int, int]:
    """Rows and index-metadata bytes of these views stacked (padded to the longest)."""
    stacked = IndexView.stack(views)
    rows = stacked.keys.nbytes + stacked.values.nbytes
    meta = stacked.offsets.nbytes + stacked.sizes.nbytes + sum(
        t.nbytes for t in stacked.meta.values())
    return rows, meta


def _one_by_one(store: Store, seqs: list, q: torch.Tensor) -> torch.Tensor:
    return torch.cat([store.query([s], 0, q[b:b + 1]).out for b, s in enumerate(seqs)])


def test_a_padded_stack_is_charged_while_its_batch_is_queried():
    store, seqs = _filled([200, 120, 200])
    used = store.memory()[GPU][0]
    store.query(seqs, 0, _q(3))
    rows, meta = _stack_bytes([s.layers[0].view() for s in seqs])
    assert store.memory()[GPU][0] == used + rows + meta
    store.query(seqs, 0, _q(3))  # the cached stack: nothing charged again
    assert store.memory()[GPU][0] == used + rows + meta
    store.query(seqs[:2], 0, _q(2))  # another batch replaces the stack and its charge
    rows, meta = _stack_bytes([s.layers[0].view() for s in seqs[:2]])
    assert store.memory()[GPU][0] == used + rows + meta
    with pytest.raises(RuntimeError, match="undo"), store.transaction():
        raise RuntimeError("undo")  # a rollback forgets the stacks and returns the charge
    assert store.memory()[GPU][0] == used
    store.close()


@pytest.mark.parametrize("lengths", [[200, 120], [200, 200]])
def test_pinned_rows_of_a_stack_are_charged_to_the_pinned_budget(lengths):
    pinned = StoreConfig.from_dict({**CFG, "kvstore": {"kind": "pinned"}}).to_dict()
    store, seqs = _filled(lengths, pinned)
    before = store.memory()
    store.query(seqs, 0, _q(2))
    rows, meta = _stack_bytes([s.layers[0].view() for s in seqs])
    after = store.memory()
    # equal rows are shared: the stack's charge went with the sequences' own rows
    held = rows if lengths[0] != lengths[1] else 0
    assert after["kvstore.pinned_budget_gb"][0] == before["kvstore.pinned_budget_gb"][0] + held
    assert after["kvstore.pinned_budget_gb"][1] == before["kvstore.pinned_budget_gb"][0] + rows
    assert after[GPU][0] == before[GPU][0] + meta
    store.close()
    assert store.memory()["kvstore.pinned_budget_gb"][0] == 0


@pytest.mark.parametrize("lengths", [[200, 120, 200], [200, 200, 200]])
def test_a_stack_over_budget_reads_each_row_on_its_own(lengths):
    probe, _ = _filled(lengths)
    used = probe.memory()[GPU][0]
    probe.close()
    tight = {**CFG, "kvstore": {"gpu_budget_gb": (used + 1024) / 2**30}}
    store, seqs = _filled(lengths, tight)
    assert store.memory()[GPU][0] == used
    own = [s.layers[0].rows.keys.untyped_storage().data_ptr() for s in seqs]
    q = _q(3)
    res = store.query(seqs, 0, q)
    torch.testing.assert_close(res.out, _one_by_one(store, seqs, q), rtol=0, atol=0)
    assert store.memory()[GPU][:2] == (used, used)  # no stack, not even for a moment
    assert [s.layers[0].rows.keys.untyped_storage().data_ptr() for s in seqs] == own
    store.close()
