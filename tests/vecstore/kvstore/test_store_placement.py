"""The store places each layer's indexed rows through the configured KV tier, under budget.

CPU-only runs check the split between tiers by putting a layer on the ``meta`` device: its
index metadata and steady zone follow the layer, its rows follow ``kvstore.kind``.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import exact_attention, rel_err
from vecstore import Store
from vecstore.buffer import WaveBuffer
from vecstore.errors import CapacityError, ConfigError
from vecstore.executor.base import EXECUTORS
from vecstore.executor.torch_ref import TorchExecutor

H, D = 2, 8
SMALL = {"index": {"kind": "wave", "tokens_per_cluster": 4, "segment_tokens": 32},
         "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 7,
                       "retrieval_budget": 0.3, "estimation_budget": 0.5}}
PINNED_NAME = "kvstore.pinned_budget_gb"
GPU_NAME = "kvstore.gpu_budget_gb on cpu"


def _cfg(kind: str = "memory", **kv: float) -> dict:
    return {**SMALL, "kvstore": {"kind": kind, **kv}}


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)


def _row_bytes(n: int) -> int:
    return 2 * H * n * D * 4  # keys and values, float32


def _fill(store: Store, name: str = "s", n: int = 120, layers: int = 1):
    seq = store.create(name, num_layers=layers, num_kv_heads=H, head_dim=D, dtype="float32")
    k, v = _kv(n)
    for layer in range(layers):
        seq.append(layer, k, v)
    return seq


@pytest.mark.parametrize("kind", ["memory", "pinned"])
def test_rows_are_one_tier_allocation_shared_by_segments_and_view(kind):
    with Store.open(config=_cfg(kind)) as store:
        seq = _fill(store)
        state = seq.layers[0]
        rows = state.rows
        assert rows is not None and len(state.segments) > 1
        assert rows.keys.shape == (H, state.num_indexed, D) and rows.keys.is_contiguous()
        view = seq.view(0)
        assert view.keys.data_ptr() == rows.keys.data_ptr()  # the view is the tier's rows
        assert view.values.data_ptr() == rows.values.data_ptr()
        for s in state.segments:  # every segment reads its slice of the same allocation
            assert s.keys.untyped_storage().data_ptr() == rows.keys.untyped_storage().data_ptr()
        used = store.memory()
        if kind == "pinned":
            assert rows.keys.is_pinned() == torch.cuda.is_available()
            assert used[PINNED_NAME][0] == rows.num_bytes == _row_bytes(state.num_indexed)
            assert used[GPU_NAME][0] > 0  # the metadata
        else:
            assert PINNED_NAME not in used
            assert used[GPU_NAME][0] > rows.num_bytes  # rows and metadata on the device


@pytest.mark.parametrize("kind", ["memory", "pinned"])
def test_rows_follow_the_kind_and_metadata_the_layer_device(kind):
    with Store.open(config=_cfg(kind)) as store:
        seq = _fill(store, layers=2)
        seq.place(["cpu", "meta"])
        state = seq.layers[1]
        meta = [state.sink_keys, state.pending_keys,
                *[t for s in state.segments for t in (s.offsets, *s.meta.values())]]
        assert all(t.device.type == "meta" for t in meta)
        rows_dev = "cpu" if kind == "pinned" else "meta"
        assert state.rows.keys.device.type == rows_dev
        assert all(s.keys.device.type == rows_dev for s in state.segments)
        view = seq.view(1)
        assert view.keys.device.type == rows_dev
        assert view.meta["centroids"].device.type == "meta"
        assert seq.layers[0].rows.keys.device.type == "cpu"
        accounts = store.memory()
        assert accounts["kvstore.gpu_budget_gb on meta"][0] > 0
        if kind == "pinned":
            # rows did not move: the pinned tier still holds both layers once
            assert accounts[PINNED_NAME][0] == 2 * _row_bytes(state.num_indexed)


@pytest.mark.parametrize("budgets", [{}, {"pinned_budget_gb": 1.0, "gpu_budget_gb": 1.0}])
def test_queries_equal_the_default_placement(budgets):
    k, v = _kv(300, seed=1)
    q = torch.randn(2 * H, 1, D, generator=torch.Generator().manual_seed(2))
    results = {}
    for kind in ("memory", "pinned"):
        with Store.open(config=_cfg(kind, **budgets)) as store:
            seq = store.create("s", num_layers=1, num_kv_heads=H, head_dim=D, dtype="float32")
            seq.append(0, k[:, :200], v[:, :200])
            for t in range(200, 300, 9):  # decode growth: segments added one by one
                seq.append(0, k[:, t:t + 9], v[:, t:t + 9])
            other = store.create("o", num_layers=1, num_kv_heads=H, head_dim=D,
                                 dtype="float32")
            other.append(0, k[:, :150], v[:, :150])
            res = seq.query(0, q)
            batch = store.query([seq, other], 0, torch.stack([q, q]))
            results[kind] = (res.out, res.lse, seq.search(0, q, 5).ids, batch.out)
    for a, b in zip(results["memory"], results["pinned"], strict=True):
        assert torch.equal(a, b)
    # and a full retrieval budget over placed rows is still exact
    with Store.open(config={**_cfg("pinned"), "attention": {
            **SMALL["attention"], "retrieval_budget": 1.0}}) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=H, head_dim=D, dtype="float32")
        seq.append(0, k, v)
        res = seq.query(0, q)
    assert rel_err(res.out, exact_attention(q, k, v)[0]) < 1e-5


def _snapshot(seq):
    state = seq.layers[0]
    return (seq.num_tokens, [s.start for s in state.segments], state.pending_keys.clone(),
            state.rows.keys.data_ptr() if state.rows is not None else None, state.version)


@pytest.mark.parametrize(("kind", "key", "name"), [
    ("pinned", "pinned_budget_gb", PINNED_NAME),
    ("memory", "gpu_budget_gb", GPU_NAME),
])
def test_a_budget_too_small_fails_the_append_and_changes_nothing(kind, key, name):
    # room for the first segments, not for the layer grown by the next ones
    budget = 1.6 * _row_bytes(120) / 2**30
    with Store.open(config=_cfg(kind, **{key: budget})) as store:
        seq = _fill(store, n=120)
        q = torch.randn(H, 1, D)
        before, out = _snapshot(seq), seq.query(0, q).out
        used = store.memory()[name][0]
        k, v = _kv(60, seed=3)
        with pytest.raises(CapacityError) as err:
            seq.append(0, k, v)
        msg = str(err.value)
        assert name in msg and "layer 0 of sequence 's'" in msg
        assert "in use" in msg and "raise the budget" in msg
        after = _snapshot(seq)
        assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
        assert torch.equal(after[2], before[2])
        assert store.memory()[name][0] == used
        assert torch.equal(seq.query(0, q).out, out)
        seq.append(0, k[:, :2], v[:, :2])  # appends that index nothing still work


def test_peak_is_charged_while_a_layer_grows():
    with Store.open(config=_cfg("pinned")) as store:
        seq = _fill(store, n=120)
        n_old = seq.layers[0].num_indexed
        k, v = _kv(40, seed=4)
        seq.append(0, k, v)
        n_new = seq.layers[0].num_indexed
        used, peak, _ = store.memory()[PINNED_NAME]
        assert used == _row_bytes(n_new)
        assert peak == _row_bytes(n_old) + _row_bytes(n_new)  # both, while copying


def test_a_pinned_layer_grows_in_place_and_persists_as_written(tmp_path):
    # segment after segment, the pinned tier grows the layer's rows within a reserve: one
    # move into it, then in place, each head's rows contiguous, only the rows charged
    k, v = _kv(600, seed=8)
    q = torch.randn(2 * H, 1, D, generator=torch.Generator().manual_seed(9))
    with Store.open(tmp_path / "db", config=_cfg("pinned")) as store:
        seq = store.create("s", num_layers=1, num_kv_heads=H, head_dim=D, dtype="float32")
        seq.append(0, k[:, :100], v[:, :100])
        state = seq.layers[0]
        addresses = []
        for t in range(100, 600, 50):
            seq.append(0, k[:, t:t + 50], v[:, t:t + 50])
            rows = state.rows
            addresses.append(rows.keys.data_ptr())
            assert rows.keys.shape == (H, state.num_indexed, D)
            assert rows.keys.stride()[1:] == (D, 1) and rows.keys.stride(0) > D * 600
            assert store.memory()[PINNED_NAME][0] == _row_bytes(state.num_indexed)
            for s in state.segments:  # segments and view read the grown rows
                assert s.keys.untyped_storage().data_ptr() == addresses[-1]
            assert seq.view(0).keys.data_ptr() == addresses[-1]
        assert len(set(addresses)) == 1  # moved once (the first growth), then in place
        out = seq.query(0, q).out
        stored = [(s.start, s.keys.clone(), s.values.clone()) for s in state.segments]
    with Store.open(tmp_path / "db", config=_cfg("memory")) as store:
        seq = store.sequence("s")
        assert torch.equal(seq.query(0, q).out, out)
        again = [(s.start, s.keys, s.values) for s in seq.layers[0].segments]
        for (a, ka, va), (b, kb, vb) in zip(stored, again, strict=True):
            assert a == b and torch.equal(ka, kb) and torch.equal(va, vb)


def test_drop_frees_rows_only_once_committed():
    with Store.open(config=_cfg("pinned")) as store:
        seq = _fill(store)
        keep = _fill(store, "keep")
        held = store.memory()[PINNED_NAME][0]
        with pytest.raises(RuntimeError, match="boom"), store.transaction():
            store.drop("s")
            raise RuntimeError("boom")
        assert store.memory()[PINNED_NAME][0] == held  # rolled back: still there
        assert seq.query(0, torch.randn(H, 1, D)).out.shape == (H, 1, D)
        store.drop("s")
        assert store.memory()[PINNED_NAME][0] == held // 2
        assert seq.layers[0].rows is None and not seq.layers[0].segments
        store.drop("keep")
        assert store.memory()[PINNED_NAME][0] == 0
        assert store.memory()[GPU_NAME][0] == 0
        assert keep.is_dropped


def test_rollback_of_an_append_returns_its_rows():
    with Store.open(config=_cfg("pinned")) as store:
        seq = _fill(store, n=60)
        held = store.memory()[PINNED_NAME][0]
        q = torch.randn(H, 1, D)
        out = seq.query(0, q).out
        with pytest.raises(RuntimeError, match="boom"), store.transaction():
            seq.append(0, *_kv(100, seed=5))
            assert store.memory()[PINNED_NAME][0] > held
            raise RuntimeError("boom")
        assert torch.equal(seq.query(0, q).out, out)  # re-placed as it was
        assert store.memory()[PINNED_NAME][0] == held
        assert seq.layers[0].rows.keys.shape[1] == seq.layers[0].num_indexed


def test_reopened_store_places_rows_in_the_configured_tier(tmp_path):
    q = torch.randn(H, 1, D, generator=torch.Generator().manual_seed(6))
    with Store.open(tmp_path / "db", config=_cfg("memory")) as store:
        seq = _fill(store, n=200)
        expected = seq.query(0, q).out
        need = _row_bytes(seq.layers[0].num_indexed)
    with Store.open(tmp_path / "db", config=_cfg("pinned")) as store:
        seq = store.sequence("s")
        assert store.memory()[PINNED_NAME][0] == 0  # lazy: nothing read yet
        assert torch.equal(seq.query(0, q).out, expected)
        state = seq.layers[0]
        assert state.rows.keys.is_pinned() == torch.cuda.is_available()
        assert seq.view(0).keys.data_ptr() == state.rows.keys.data_ptr()
        assert store.memory()[PINNED_NAME][0] == need
        seq.append(0, *_kv(30, seed=7))  # grows through the tier too
        need = _row_bytes(state.num_indexed)
        assert store.memory()[PINNED_NAME][0] == need
    # a budget that cannot hold the stored rows is refused at open, naming the numbers
    small = {"kvstore": {"kind": "pinned", "pinned_budget_gb": need / 2 / 2**30}}
    with pytest.raises(CapacityError, match=f"{PINNED_NAME}: .* need {need} bytes"):
        Store.open(tmp_path / "db", config={**_cfg("pinned"), **small})
    with Store.open(tmp_path / "db", config=_cfg("pinned")) as store:  # lock was released
        assert store.sequences() == ["s"]


def test_unknown_kind_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown kvstore 'disk': available \['memory', "
                                          r"'pinned'\]"):
        Store.open(config={"kvstore": {"kind": "disk"}})


# -- the wave buffer charges the store's GPU budget --------------------------------------
class _BufferedExecutor(TorchExecutor):
    """The reference, plus a wave buffer per view built the way WaveExecutor builds one."""

    def __init__(self, device: str = "cpu", accounts=None) -> None:
        super().__init__(device)
        self.accounts = accounts
        self.buffers: dict[int, WaveBuffer] = {}
        self.retired: list[int] = []

    @classmethod
    def from_config(cls, config, accounts=None):
        return cls(config.executor.device, accounts)

    def run(self, index, view, steady, q, scale, layer, softcap=None):
        if view is not None and id(view) not in self.buffers:
            B, Hk, C = view.sizes.shape
            keys = view.keys.reshape(B * Hk, -1, view.keys.shape[-1])
            dev = torch.device("cpu")
            self.buffers[id(view)] = WaveBuffer(
                keys, keys, num_clusters=C, r_max=4, exec_rows=64, num_slots=4, slot_tokens=8,
                device=dev, account=self.accounts(dev))
        return super().run(index, view, steady, q, scale, layer, softcap)

    def release_view(self, view) -> None:
        self.retired.append(id(view))
        buf = self.buffers.pop(id(view), None)
        if buf is not None:
            buf.close()


@pytest.fixture(autouse=True)
def _registered():
    """The test executor is registered for the tests of this module only."""
    EXECUTORS.register("test_buffered")(_BufferedExecutor)
    yield
    EXECUTORS.unregister("test_buffered")


def _buffered(kind: str = "pinned", gpu: float = 0.0) -> dict:
    return {**_cfg(kind, gpu_budget_gb=gpu), "executor": {"kind": "test_buffered"}}


def test_wave_buffers_charge_the_gpu_budget_and_are_released_with_their_view():
    with Store.open(config=_buffered()) as store:
        seq = _fill(store, n=120)
        meta = store.memory()[GPU_NAME][0]
        seq.query(0, torch.randn(H, 1, D))
        (buf,) = store.executor.buffers.values()
        assert store.memory()[GPU_NAME][0] == meta + buf.num_bytes
        old = id(seq.view(0))
        seq.append(0, *_kv(40, seed=8))  # a new segment: the old view is retired
        assert store.executor.retired == [old]
        meta = store.memory()[GPU_NAME][0]  # the grown layer's metadata, no buffer
        seq.query(0, torch.randn(H, 1, D))
        (buf,) = store.executor.buffers.values()
        assert store.memory()[GPU_NAME][0] == meta + buf.num_bytes
        store.drop("s")
        assert store.memory()[GPU_NAME][0] == 0  # metadata and buffer returned


def test_a_gpu_budget_too_small_for_the_buffer_fails_before_allocating():
    with Store.open(config=_buffered(gpu=1.0)) as store:
        _fill(store, n=120)
        meta = store.memory()[GPU_NAME][0]
    budget = (meta + 100) / 2**30  # the metadata fits, the buffer does not
    with Store.open(config=_buffered(gpu=budget)) as store:
        seq = _fill(store, n=120)
        with pytest.raises(CapacityError, match=f"{GPU_NAME}: a wave buffer .* in use"):
            seq.query(0, torch.randn(H, 1, D))
        assert store.memory()[GPU_NAME][0] == meta
        assert not store.executor.buffers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("executor", ["torch", "wave"])
def test_pinned_rows_answer_cuda_queries_as_device_rows(executor):
    gen = torch.Generator().manual_seed(4)
    heads, dim, n = 2, 32, 3000
    k, v = torch.randn(heads, n, dim, generator=gen), torch.randn(heads, n, dim, generator=gen)
    q = torch.randn(4 * heads, 1, dim, generator=gen).cuda()
    out = {}
    for kind in ("memory", "pinned"):
        cfg = {"kvstore": {"kind": kind}, "executor": {"kind": executor, "device": "cuda"},
               "index": {"segment_tokens": 1024}}
        with Store.open(config=cfg) as store:
            seq = store.create("s", num_layers=1, num_kv_heads=heads, head_dim=dim,
                               dtype="float32")
            seq.append(0, k, v)
            rows = seq.layers[0].rows
            assert rows is not None and rows.keys.is_cuda == (kind == "memory")
            assert rows.keys.is_pinned() == (kind == "pinned")
            out[kind] = seq.query(0, q).out.cpu()
    assert rel_err(out["pinned"], out["memory"]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_queries_over_pinned_rows_on_cuda():
    gen = torch.Generator().manual_seed(5)
    heads, dim = 2, 32
    kv = [(torch.randn(heads, n, dim, generator=gen), torch.randn(heads, n, dim, generator=gen))
          for n in (3000, 2200)]
    q = torch.randn(2, 4 * heads, 1, dim, generator=gen).cuda()
    out = {}
    for kind in ("memory", "pinned"):
        cfg = {"kvstore": {"kind": kind}, "executor": {"kind": "wave", "device": "cuda"},
               "index": {"segment_tokens": 1024}}
        with Store.open(config=cfg) as store:
            seqs = []
            for i, (k, v) in enumerate(kv):
                seq = store.create(f"s{i}", num_layers=1, num_kv_heads=heads, head_dim=dim,
                                   dtype="float32")
                seq.append(0, k, v)
                seqs.append(seq)
            out[kind] = store.query(seqs, 0, q).out.cpu()
    assert rel_err(out["pinned"], out["memory"]) < 1e-5
