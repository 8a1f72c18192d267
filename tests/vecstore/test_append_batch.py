"""Store.append_batch: the batched append equals one append per row, checks every row
before storing anything, and the batch's stacked steady zone equals the per-row one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecstore import Store
from vecstore.engine.batch_steady import stack_steady
from vecstore.errors import InvalidValueError, SequenceDroppedError, ShapeError

H, D = 2, 8
CFG = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
       "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 16}}


def _seqs(store: Store, n: int, prefix: str = "s") -> list:
    return [store.create(f"{prefix}{i}", num_layers=2, num_kv_heads=H, head_dim=D,
                         dtype=torch.float32) for i in range(n)]


def _kv(B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def _state(seq, layer: int) -> list[torch.Tensor]:
    st_ = seq.layers[layer]
    return [st_.sink_keys, st_.sink_values, st_.pending_keys, st_.pending_values,
            *[t for s in st_.segments for t in (s.keys, s.values, s.offsets)],
            *[s.meta[name] for s in st_.segments for name in sorted(s.meta)],
            torch.tensor([(s.start, s.end) for s in st_.segments]).reshape(-1, 2)]


def _assert_same_states(a: list, b: list, layer: int) -> None:
    """Each sequence of ``a`` holds ``layer`` exactly as its twin in ``b`` does."""
    for x, y in zip(a, b, strict=True):
        got, want = _state(x, layer), _state(y, layer)
        assert len(got) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), steps=st.lists(st.integers(1, 20), min_size=1, max_size=5),
       seed=st.integers(0, 2**16), kind=st.sampled_from(["wave", "quest", "flat"]),
       whole=st.booleans())
def test_append_batch_equals_one_append_per_row(B, steps, seed, kind, whole):
    # the rows' new segments are built in one index build (vecstore.engine.batch_build)
    config = {**CFG, "index": {**CFG["index"], "kind": kind}}
    with Store.open(config=config) as batched, Store.open(config=config) as single:
        a, b = _seqs(batched, B), _seqs(single, B)
        for i, T in enumerate(steps):
            k, v = _kv(B, T, seed + i)
            batched.append_batch(a, 1, k, v, whole_segments=whole)
            for row, seq in enumerate(b):
                seq.append(1, k[row], v[row], whole_segments=whole)
        q = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(seed))
        for x, y in zip(a, b, strict=True):
            assert x.tokens(1) == y.tokens(1) == sum(steps) and x.tokens(0) == 0
            assert x.layers[1].num_indexed == y.layers[1].num_indexed
        _assert_same_states(a, b, 1)
        got, want = batched.query(a, 1, q).out, single.query(b, 1, q).out
        # a shared tail buffer is read at its capacity: the same sums over more (masked) rows
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _unchanged(store: Store, seqs: list, bad: dict, error: type, match: str) -> None:
    before = [[t.clone() for t in _state(s, 0)] for s in seqs]
    k, v = _kv(len(seqs), 4, 1)
    args = {"seqs": seqs, "layer": 0, "keys": k, "values": v, **bad}
    with pytest.raises(error, match=match):
        store.append_batch(**args)
    for s, old in zip(seqs, before, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(_state(s, 0), old, strict=True))


def test_bad_batches_raise_and_store_nothing():
    with Store.open(config=CFG) as store, Store.open(config=CFG) as other:
        seqs = _seqs(store, 3)
        k, v = _kv(3, 20, 0)
        store.append_batch(seqs, 0, k, v)
        nan = k[:, :, :4].clone()
        nan[2, 1, 3, 0] = float("nan")
        _unchanged(store, seqs, {"keys": nan}, InvalidValueError, "keys")
        inf = v[:, :, :4].clone()
        inf[0, 0, 0, 5] = float("inf")
        _unchanged(store, seqs, {"values": inf}, InvalidValueError, "values")
        _unchanged(store, seqs, {"keys": torch.randn(2, H, 4, D)}, ShapeError, "keys")
        _unchanged(store, seqs, {"values": torch.randn(3, H, 5, D)}, ShapeError, "values")
        _unchanged(store, seqs, {"keys": torch.randn(3, H, 0, D),
                                 "values": torch.randn(3, H, 0, D)}, ShapeError, "at least one")
        _unchanged(store, seqs, {"keys": k[:, :, :4].double()}, ShapeError, "dtype")
        _unchanged(store, seqs, {"layer": 2}, InvalidValueError, "layer")
        _unchanged(store, seqs, {"seqs": [*seqs[:2], _seqs(other, 1)[0]]}, InvalidValueError,
                   "Sequence of this store")
        wide = store.create("wide", num_layers=2, num_kv_heads=2 * H, head_dim=D,
                            dtype=torch.float32)
        _unchanged(store, seqs, {"seqs": [*seqs[:2], wide]}, InvalidValueError, "differ")
        store.drop(seqs[1].name)
        _unchanged(store, [seqs[0], seqs[2]], {"seqs": seqs}, SequenceDroppedError, "dropped")
        with pytest.raises(InvalidValueError, match="non-empty"):
            store.append_batch([], 0, k, v)


@pytest.mark.parametrize("lengths", [[30, 30, 30], [2, 2], [30, 9, 2], [1, 40]])
def test_stacked_steady_zone_equals_each_row_padded(lengths):
    with Store.open(config=CFG) as store:
        seqs = _seqs(store, len(lengths))
        for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            k, v = _kv(1, n, i)
            seq.append(0, k[0], v[0])
        steady = stack_steady(seqs, 0)
        S = max(s.layers[0].steady()[0].shape[1] for s in seqs)
        if steady.persistent:  # equal rows: their shared buffer, at its capacity
            assert len(set(lengths)) == 1 and steady.keys is seqs[0].layers[0].tail_buffer.keys
            assert steady.keys.shape == (len(seqs), H, 3 + 5 + 16, D)
        else:
            assert steady.keys.shape == (len(seqs), H, S, D)
        for row, seq in enumerate(seqs):
            keys, values = seq.layers[0].steady()
            n = keys.shape[1]
            assert int(steady.lengths[row]) == n
            assert torch.equal(steady.keys[row, :, :n], keys)
            assert torch.equal(steady.values[row, :, :n], values)
            assert not steady.keys[row, :, n:].any() and not steady.values[row, :, n:].any()


_OPS = st.lists(st.one_of(
    st.tuples(st.just("batch"), st.integers(1, 3)),
    st.tuples(st.just("row"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("rollback"), st.integers(1, 20))), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None)
@given(ops=_OPS, seed=st.integers(0, 2**16))
def test_decode_steps_through_the_shared_tail_equal_appends_row_by_row(ops, seed):
    """Decode-sized batched appends (through the batch's shared tail buffer), appends of one
    row, and rolled-back appends leave every row as appending row by row does."""
    with Store.open(config=CFG) as batched, Store.open(config=CFG) as single:
        a, b = _seqs(batched, 3), _seqs(single, 3)
        k, v = _kv(3, 9, seed)
        batched.append_batch(a, 0, k, v)
        for row, seq in enumerate(b):
            seq.append(0, k[row], v[row])
        for i, op in enumerate(ops):
            if op[0] == "batch":
                k, v = _kv(3, op[1], seed + i)
                batched.append_batch(a, 0, k, v)
                for row, seq in enumerate(b):
                    seq.append(0, k[row], v[row])
            elif op[0] == "row":
                k, v = _kv(1, op[2], seed + i)
                a[op[1]].append(0, k[0], v[0])
                b[op[1]].append(0, k[0], v[0])
            else:
                with pytest.raises(RuntimeError, match="boom"), batched.transaction():
                    batched.append_batch(a, 0, *_kv(3, op[1], seed + i))
                    raise RuntimeError("boom")
            _assert_same_states(a, b, 0)


def test_a_decode_step_of_a_batch_shares_one_tail_buffer():
    with Store.open(config=CFG) as store:
        seqs = _seqs(store, 4)
        store.append_batch(seqs, 0, *_kv(4, 8, 0))
        store.append_batch(seqs, 0, *_kv(4, 1, 1))
        first = seqs[0].layers[0].tail_buffer
        assert first is not None and all(s.layers[0].tail_buffer is first for s in seqs)
        held = seqs[2].layers[0].pending_keys.clone()
        store.append_batch(seqs, 0, *_kv(4, 1, 2))
        assert all(s.layers[0].tail_buffer is first for s in seqs)  # written in place
        assert torch.equal(seqs[2].layers[0].pending_keys[:, :-1], held)
        steady = stack_steady(seqs, 0)  # the shared buffer itself, at its capacity
        assert steady.keys is first.keys and steady.values is first.values
        assert steady.lengths.tolist() == [3 + 7] * 4  # 3 sinks, a tail of 7
        for row, seq in enumerate(seqs):
            keys, values = seq.layers[0].steady()
            n = keys.shape[1]
            assert torch.equal(steady.keys[row, :, :n], keys)
            assert torch.equal(steady.values[row, :, :n], values)
        moved = seqs[3].layers[0]
        moved.to(torch.device("meta"))  # its tail is a new tensor there: the link goes
        assert moved.tail_buffer is None and seqs[0].layers[0].tail_buffer is first


@pytest.mark.parametrize("lengths", [[70, 70, 70], [70, 45, 70]])
def test_sealing_a_batch_equals_sealing_each_row(lengths):
    # rows with as many tail tokens to index are built in one index build
    with Store.open(config=CFG) as batched, Store.open(config=CFG) as single:
        a, b = _seqs(batched, len(lengths)), _seqs(single, len(lengths))
        for row, n in enumerate(lengths):
            k, v = _kv(1, n, row)
            for seq in (a[row], b[row]):
                seq.append(1, k[0], v[0], whole_segments=True)
        batched.seal(a, 1)
        for seq in b:
            single.seal([seq], 1)
        for x in a:
            assert x.layers[1].pending_keys.shape[1] == CFG["attention"]["window_tokens"]
        _assert_same_states(a, b, 1)


def test_rows_reaching_a_segment_boundary_together_are_built_in_one_index_build(monkeypatch):
    with Store.open(config=CFG) as store:
        seqs = _seqs(store, 3)
        index = seqs[0].layers[1].index
        calls = []
        build = index.build

        def counted(keys, values, start):
            calls.append(keys.shape[0])
            return build(keys, values, start)

        monkeypatch.setattr(index, "build", counted)
        k, v = _kv(3, 70, 4)
        store.append_batch(seqs, 1, k, v, whole_segments=True)
        assert calls == [3 * H]  # the three rows' heads stacked, one call
        k, v = _kv(2, 70, 5)
        store.append_batch(seqs[:2], 1, k, v, whole_segments=True)
        store.append_batch(seqs[2:], 1, k[:1, :, :30], v[:1, :, :30], whole_segments=True)
        store.seal(seqs, 1)  # two rows with as many tail tokens, one with more
        assert calls[1:] == [2 * H, H, 2 * H, H]
