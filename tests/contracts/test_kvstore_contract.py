"""The :class:`~vecstore.kvstore.KVStore` contract, for every tier in ``KVSTORES``.

Each tier is built as a store's placement builds it (:func:`~vecstore.kvstore.make_kvstore`)
and must keep rows exactly, say where they live, and charge its budget before allocating.
"""

from __future__ import annotations

import pytest
import torch

from vecstore.errors import CapacityError, InvalidValueError
from vecstore.kvstore import KVSTORES, KVStore, MemoryAccount, make_kvstore
from vecstore.kvstore.base import growable_rows

KINDS = KVSTORES.names()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_is_a_tier_that_says_where_its_rows_live(kind: str) -> None:
    tier = make_kvstore(kind)
    assert isinstance(tier, KVStore) and isinstance(tier.device, torch.device)
    assert type(tier).resident in (True, False)
    assert type(tier).shareable_rows in (True, False)
    assert (tier.account.used_bytes, tier.account.budget_bytes) == (0, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2, 37, 8), (2, 1, 1, 4), (1, 1, 0, 16)])
def test_stored_rows_come_back_exactly(kind: str, dtype: torch.dtype,
                                       shape: tuple[int, ...]) -> None:
    tier = make_kvstore(kind)
    keys, values = _rows(shape, dtype, 0), _rows(shape, dtype, 1)
    rows = tier.store(keys, values)
    assert rows.keys.device == rows.values.device == tier.device
    assert rows.keys.dtype == rows.values.dtype == dtype
    assert torch.equal(rows.keys.cpu(), keys) and torch.equal(rows.values.cpu(), values)
    assert rows.keys.is_contiguous() and rows.values.is_contiguous()
    assert rows.keys.data_ptr() != keys.data_ptr() or keys.numel() == 0
    expected = 2 * keys.numel() * keys.element_size()
    assert rows.num_bytes == tier.account.used_bytes == tier.account.peak_bytes == expected
    tier.free(rows)
    assert tier.account.used_bytes == 0 and tier.account.peak_bytes == expected


@pytest.mark.parametrize("kind", KINDS)
def test_allocate_gives_rows_of_the_shape_in_the_tier(kind: str) -> None:
    tier = make_kvstore(kind)
    rows = tier.allocate((3, 5, 8), torch.float16, "layer 0")
    assert rows.keys.shape == rows.values.shape == (3, 5, 8)
    assert rows.keys.dtype == torch.float16 and rows.keys.device == tier.device
    rows.keys.fill_(2.0)
    rows.values.copy_(rows.keys)
    assert rows.keys.data_ptr() != rows.values.data_ptr()
    assert rows.num_bytes == tier.account.used_bytes == 2 * 3 * 5 * 8 * 2
    tier.free(rows)
    assert tier.account.used_bytes == 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_budget_is_checked_before_anything_is_placed(kind: str) -> None:
    tier = make_kvstore(kind, budget_gb=8192 / 2**30)  # 8 KiB
    keys = _rows((1, 2, 16, 32), torch.float32, 2)  # 4 KiB each for keys and values
    rows = tier.store(keys, keys)
    assert torch.equal(rows.keys.cpu(), keys) and rows.num_bytes == 8192
    for place, what in ((lambda: tier.store(keys[:, :, :1], keys[:, :, :1]),
                         r"rows \(1, 2, 1, 32\) needs 512"),
                        (lambda: tier.allocate((1, 1, 1, 32), torch.float32, "layer 7"),
                         "layer 7 needs 256")):
        with pytest.raises(CapacityError, match=what + r" more bytes .* over the budget of "
                                                       r"8192 .* with 8192 .* in use; raise"):
            place()
        assert tier.account.used_bytes == 8192
    tier.free(rows)
    assert tier.account.used_bytes == 0 and tier.account.peak_bytes == 8192
    tier.free(tier.store(keys, keys))


@pytest.mark.parametrize("kind", [k for k in KINDS if KVSTORES.get(k).resident])
def test_a_resident_tier_charges_the_account_it_is_given(kind: str) -> None:
    shared = MemoryAccount(1 << 20, "kvstore.gpu_budget_gb on cpu")
    tier = make_kvstore(kind, device="cpu", account=shared)
    assert tier.account is shared and tier.device == torch.device("cpu")
    rows = tier.store(_rows((1, 1, 8, 4), torch.float32, 3), _rows((1, 1, 8, 4), torch.float32, 4))
    assert shared.used_bytes == rows.num_bytes == 256
    tier.free(rows)
    assert shared.used_bytes == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extended_rows_keep_theirs_and_charge_what_they_add(kind: str,
                                                            dtype: torch.dtype) -> None:
    tier = make_kvstore(kind)
    keys, values = _rows((3, 37, 8), dtype, 3), _rows((3, 37, 8), dtype, 4)
    rows = tier.store(keys, values)
    held = [(keys, values)]
    for n in (37, 40, 300, 301, 2000):
        grown = tier.extend(rows, n, "layer 0")
        if grown is None:  # the tier does not grow rows: nothing changed
            assert tier.account.used_bytes == rows.num_bytes
            break
        rows = grown
        assert rows.keys.shape == rows.values.shape == (3, n, 8)
        assert rows.keys.device == tier.device and rows.keys.dtype == dtype
        for x in (rows.keys, rows.values):  # every head's rows contiguous
            assert x.stride()[1:] == (8, 1) and x.stride(0) >= n * 8
        assert rows.num_bytes == tier.account.used_bytes == 2 * 3 * n * 8 * keys.element_size()
        for k, v in held:  # rows written before are kept, new rows are writable
            m = k.shape[1]
            assert torch.equal(rows.keys[:, :m].cpu(), k)
            assert torch.equal(rows.values[:, :m].cpu(), v)
        new = _rows((3, n - held[-1][0].shape[1], 8), dtype, n)
        rows.keys[:, held[-1][0].shape[1]:] = new.to(rows.keys.device)
        rows.values[:, held[-1][0].shape[1]:] = (-new).to(rows.keys.device)
        held.append((rows.keys.cpu().clone(), rows.values.cpu().clone()))
    tier.free(rows)
    assert tier.account.used_bytes == 0


@pytest.mark.parametrize("kind", KINDS)
def test_extending_past_the_budget_changes_nothing(kind: str) -> None:
    tier = make_kvstore(kind, budget_gb=8192 / 2**30)  # 8 KiB
    keys = _rows((2, 16, 32), torch.float32, 5)
    rows = tier.store(keys, keys)
    for num_rows, error, match in ((17, CapacityError, "layer 3 needs "),
                                   (15, InvalidValueError, "num_rows: expected >= the 16")):
        try:
            grown = tier.extend(rows, num_rows, "layer 3")
        except error as e:
            assert match in str(e)
        else:
            assert grown is None  # a tier that grows rows must refuse these
        assert tier.account.used_bytes == 8192 and torch.equal(rows.keys.cpu(), keys)
    tier.free(rows)
    assert tier.account.used_bytes == 0


@pytest.mark.parametrize("kind", KINDS)
def test_growable_rows_are_allocated_rows_that_extend_keeps(kind: str) -> None:
    tier = make_kvstore(kind, budget_gb=4096 / 2**30)  # 4 KiB
    rows = growable_rows(tier, (2, 3, 5, 8), torch.float32, "a stack")
    assert rows.keys.shape == rows.values.shape == (2, 3, 5, 8)
    assert rows.keys.device == tier.device and rows.keys.dtype == torch.float32
    assert rows.num_bytes == tier.account.used_bytes == 2 * 2 * 3 * 5 * 8 * 4
    keys = _rows((2, 3, 5, 8), torch.float32, 6)
    rows.keys.copy_(keys)
    rows.values.copy_(-keys)
    with pytest.raises(CapacityError, match="a stack needs 4096 more bytes"):
        growable_rows(tier, (2, 1, 32, 8), torch.float32, "a stack")
    assert tier.account.used_bytes == rows.num_bytes
    grown = tier.extend(rows, 6, "a stack")
    if grown is not None:
        assert torch.equal(grown.keys[:, :, :5].cpu(), keys)
        assert torch.equal(grown.values[:, :, :5].cpu(), -keys)
        rows = grown
    tier.free(rows)
    assert tier.account.used_bytes == 0


@pytest.mark.parametrize("kind", KINDS)
def test_split_rows_are_the_batch_rows_charged_in_parts(kind: str) -> None:
    tier = make_kvstore(kind)
    rows = growable_rows(tier, (3, 2, 5, 8), torch.float32, "a stack")
    keys = _rows((3, 2, 5, 8), torch.float32, 7)
    rows.keys.copy_(keys)
    rows.values.copy_(-keys)
    parts = tier.split(rows)
    assert [p.keys.data_ptr() for p in parts] == [rows.keys[b].data_ptr() for b in range(3)]
    assert all(torch.equal(p.keys.cpu(), keys[b]) and torch.equal(p.values.cpu(), -keys[b])
               for b, p in enumerate(parts))
    assert sum(p.num_bytes for p in parts) == rows.num_bytes == tier.account.used_bytes
    grown = tier.extend(parts[1], 40, "batch row 1")  # one part grows on its own
    if grown is not None:
        parts[1] = grown
        assert torch.equal(grown.keys[:, :5].cpu(), keys[1])
    tier.free(parts[0])
    assert all(torch.equal(p.keys[:, :5].cpu(), keys[b]) for b, p in enumerate(parts))
    for p in parts[1:]:
        tier.free(p)
    assert tier.account.used_bytes == 0
