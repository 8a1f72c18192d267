"""Index views a layer or a batch replaces travel up to the engine, which lets the
executor release what it prepared for them: after appends, rollbacks, drops, closes and
when a batch's stacked view is replaced."""

from __future__ import annotations

import pytest
import torch

from vecstore import Store
from vecstore.executor.base import EXECUTORS
from vecstore.executor.torch_ref import TorchExecutor

H, D = 2, 8
CONFIG = {"index": {"kind": "wave", "tokens_per_cluster": 4, "segment_tokens": 32},
          "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 7},
          "executor": {"kind": "test_retiring"}}


class _Recording(TorchExecutor):
    """The reference executor, noting every view it is told to release."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.released: list[int] = []

    def release_view(self, view: object) -> None:
        self.released.append(id(view))


@pytest.fixture(autouse=True)
def _recording(register):
    register(EXECUTORS, "test_retiring", _Recording)


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)


def _seq(store: Store, name: str = "s", n: int = 120):
    seq = store.create(name, num_layers=1, num_kv_heads=H, head_dim=D, dtype="float32")
    seq.append(0, *_kv(n))
    return seq


def test_an_append_that_indexes_releases_the_old_view():
    with Store.open(config=CONFIG) as store:
        seq = _seq(store)
        old = id(seq.view(0))
        seq.append(0, *_kv(40, seed=1))
        assert store.executor.released == [old]


def test_a_rollback_releases_the_views_the_transaction_built():
    with Store.open(config=CONFIG) as store:
        seq = _seq(store)
        before = seq.view(0)
        with pytest.raises(RuntimeError), store.transaction():
            seq.append(0, *_kv(40, seed=1))
            grown = id(seq.view(0))
            raise RuntimeError("undo")
        assert grown in store.executor.released
        assert seq.tokens(0) == 120 and seq.view(0).num_units.tolist() == \
            before.num_units.tolist()


def test_a_drop_and_a_close_release_every_view():
    with Store.open(config=CONFIG) as store:
        a, b = _seq(store, "a"), _seq(store, "b")
        view_a, view_b = id(a.view(0)), id(b.view(0))
        store.drop("a")
        assert store.executor.released == [view_a]
        executor = store.executor
    assert executor.released == [view_a, view_b]


def test_a_replaced_batch_view_is_released():
    with Store.open(config=CONFIG) as store:
        a, b, c = _seq(store, "a"), _seq(store, "b", 100), _seq(store, "c", 90)
        q = torch.randn(2, 4, 1, D)
        store.query([a, b], 0, q)
        stacked = set(store.executor.released)
        store.query([a, c], 0, q)  # the stack of (a, b) is replaced
        assert len(set(store.executor.released) - stacked) == 1
