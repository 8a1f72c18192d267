"""A segment flush keeps an offloaded batch's block cache: the grown view's wave buffer takes
over the clusters the old one held, in the same slots, and the answers stay the
reference's."""

from __future__ import annotations

import torch

from tests.interpreter import interpreted, request_interpreter
from tests.reference import rel_err
from vecstore import Store
from vecstore.executor import EXECUTORS
from vecstore.executor.wave_exec import WaveExecutor

request_interpreter()  # the kernels run on CPU tensors in Triton's interpreter

B, H, D = 2, 2, 16
BASE = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
        "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 8,
                      "retrieval_budget": 0.2}}
OFFLOADED = {**BASE, "kvstore": {"kind": "pinned"}, "executor": {"kind": "offloaded_wave"},
             "cache": {"capacity": 0.25}}
REFERENCE = {**BASE, "executor": {"kind": "torch"}}


class _Offloaded(WaveExecutor):
    """The wave executor serving every view through a wave buffer (offload simulated)."""

    @classmethod
    def from_config(cls, config, accounts=None):
        return cls(config.executor.device, cache_policy=config.cache.policy,
                   cache_capacity=config.cache.capacity, accounts=accounts,
                   simulate_offload=True, backend="triton", score_dtype=torch.float32)


def _filled(store: Store, gen: torch.Generator) -> list:
    seqs = [store.create(f"s{b}", num_layers=1, num_kv_heads=H, head_dim=D,
                         dtype=torch.float32) for b in range(B)]
    store.append_batch(seqs, 0, torch.randn(B, H, 200, D, generator=gen),
                       torch.randn(B, H, 200, D, generator=gen))
    return seqs


def _buffer(store: Store):
    view = store._queries._batch_views._cache[0].view
    (prep,) = [p for p in store.executor._prepared.values() if p.view is view]
    return view, prep.buffer


def _flushes(store: Store, ref: Store) -> list[tuple[int, int, bool]]:
    """Decode 20 steps of a batch through ``store`` (answers checked against ``ref``'s); at
    each flush, what the new view's first step found of the old cache: clusters lost, the
    step's misses, and whether those still cached sit in their old slots."""
    seqs, ref_seqs = _filled(store, torch.Generator().manual_seed(0)), _filled(
        ref, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    account = store.placement.device_account(torch.device("cpu"))
    held, found = None, []
    for _ in range(20):
        k, v = torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen)
        q = torch.randn(B, 2 * H, 1, D, generator=gen)
        store.append_batch(seqs, 0, k, v)
        ref.append_batch(ref_seqs, 0, k, v)
        got, want = store.query(seqs, 0, q), ref.query(ref_seqs, 0, q)
        assert rel_err(got.out, want.out) < 1e-5 and rel_err(got.lse, want.lse) < 1e-5
        view, buf = _buffer(store)
        if held is not None and view is not held[0]:  # a flush grew the view
            old_buf, slot_of, misses = held[1:]
            c_old = old_buf.num_clusters
            assert view.sizes.shape[2] > c_old and old_buf.account is None  # closed
            kept = slot_of[:, :c_old] >= 0
            still = kept & (buf.slot_of[:, :c_old] >= 0)
            found.append((int(kept.sum()) - int(still.sum()), buf.stats.misses - misses,
                          torch.equal(buf.slot_of[:, :c_old][still], slot_of[:, :c_old][still])))
        assert account.used_bytes >= buf.num_bytes  # the live buffer, charged
        held = (view, buf, buf.slot_of.clone(), buf.stats.misses)
    return found


@interpreted
def test_a_segment_flush_keeps_the_batchs_block_cache(register, monkeypatch):
    register(EXECUTORS, "offloaded_wave", _Offloaded)
    with Store.open(config=OFFLOADED) as store, Store.open(config=REFERENCE) as ref:
        found = _flushes(store, ref)
    # the clusters the old cache held stay in their slots but for those the new view's first
    # step evicted for its misses: taken over (the counters carry on, so misses counts
    # that step's)
    assert len(found) >= 2
    assert all(lost <= misses and same for lost, misses, same in found)
    # without the hand-over a flush starts a cache anew (the newest clusters, the new
    # segment's): the old clusters are gone, more than any step's misses could evict
    monkeypatch.setattr(_Offloaded, "hand_over", lambda self, old, new: None)
    with Store.open(config=OFFLOADED) as store, Store.open(config=REFERENCE) as ref:
        anew = _flushes(store, ref)
    assert any(lost > misses or not same for lost, misses, same in anew)
