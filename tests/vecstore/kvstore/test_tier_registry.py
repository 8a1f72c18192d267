"""A tier registered in ``KVSTORES`` is placed by a store with no edit to ``Placement``: it
says whether it is resident or an offload tier, and the placement builds it so."""

from __future__ import annotations

import pytest
import torch

from tests.reference import exact_attention, rel_err
from vecstore import Store
from vecstore.errors import ConfigError
from vecstore.kvstore import KVSTORES, GPUKVStore, PinnedKVStore, StoredRows

H, D, N = 2, 8, 150
CFG = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
       "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 7,
                     "retrieval_budget": 1.0}}


class _CountingDevice(GPUKVStore):
    """A resident tier that counts what it allocates."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.allocated: list[StoredRows] = []

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "") -> StoredRows:
        self.allocated.append(super().allocate(shape, dtype, what))
        return self.allocated[-1]


class _PlainHost(PinnedKVStore):
    """An offload tier in plain (never page-locked) host memory."""

    def __init__(self, *, budget_gb: float = 0.0) -> None:
        super().__init__(budget_gb=budget_gb)
        self.is_pinned = False
        self.allocated: list[StoredRows] = []

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "") -> StoredRows:
        self.allocated.append(super().allocate(shape, dtype, what))
        return self.allocated[-1]


@pytest.mark.parametrize(("tier", "account"), [
    (_CountingDevice, "kvstore.gpu_budget_gb on cpu"),
    (_PlainHost, "kvstore.pinned_budget_gb"),
])
def test_a_registered_tier_holds_the_rows_of_every_layer(register, tier, account):
    register(KVSTORES, "test_tier", tier)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(H, N, D, generator=gen), torch.randn(H, N, D, generator=gen)
    q = torch.randn(2 * H, 1, D, generator=gen)
    with Store.open(config={**CFG, "kvstore": {"kind": "test_tier"}}) as store:
        seq = store.create("s", num_layers=2, num_kv_heads=H, head_dim=D, dtype="float32")
        for layer in range(2):
            seq.append(layer, k, v)
        placed = store.placement.tier("cpu")
        assert type(placed) is tier and placed.resident == (tier is _CountingDevice)
        assert [r.keys.data_ptr() for r in placed.allocated] == [
            state.rows.keys.data_ptr() for state in seq.layers]
        assert store.memory()[account][0] >= 2 * placed.allocated[0].num_bytes
        out = seq.query(1, q).out
    assert rel_err(out, exact_attention(q, k, v)[0]) < 1e-5


def test_an_offload_tier_is_one_for_every_device_a_resident_one_is_per_device(register):
    register(KVSTORES, "test_host", _PlainHost)
    register(KVSTORES, "test_device", _CountingDevice)
    with Store.open(config={"kvstore": {"kind": "test_host"}}) as store:
        host = store.placement.tier("cpu")
        assert store.placement.tier("meta") is host and host.device == torch.device("cpu")
    with Store.open(config={"kvstore": {"kind": "test_device"}}) as store:
        cpu, meta = store.placement.tier("cpu"), store.placement.tier("meta")
        assert (cpu.device, meta.device) == (torch.device("cpu"), torch.device("meta"))
        assert meta.account is store.placement.device_account("meta")


def test_an_unregistered_tier_is_refused_naming_the_known_kinds():
    KVSTORES.register("test_tier")(_PlainHost)
    KVSTORES.unregister("test_tier")
    with pytest.raises(ConfigError, match=r"unknown kvstore 'test_tier': available "
                                          r"\['memory', 'pinned'\]"):
        Store.open(config={"kvstore": {"kind": "test_tier"}})
