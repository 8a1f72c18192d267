"""RecordPool: a wave buffer's pinned step records, reused only once the policy worker has
applied them."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_gpu_record_pool_reuses_a_record_only_once_the_worker_applied_it():
    from concurrent.futures import Future

    from vecstore.buffer.bookkeeping import RecordPool

    parts = [torch.zeros(3, 5, dtype=torch.int32, device="cuda") for _ in range(4)]
    pool = RecordPool([*parts, torch.zeros(3, dtype=torch.int32, device="cuda")], size=2)
    first = pool.take()
    assert first.ids.is_pinned() and first.count.shape == (3,)
    pending = Future()
    pool.track(first, pending)
    assert pool.take() is not first  # the worker still reads it
    pending.set_result(None)
    assert pool.take() is first
    second, third = pool.take(), pool.take()
    for rec in (first, second, third):
        done_now = Future()
        done_now.set_result(None)
        pool.track(rec, done_now)
    assert {id(pool.take()), id(pool.take())} == {id(first), id(second)}  # two kept
    fresh = pool.take()
    assert all(fresh is not r for r in (first, second, third))
