"""The KVStore interface: a tier where a layer's cluster-contiguous KV rows live.

A tier owns memory under a byte budget. Rows are placed once, when a layer's index view
is prepared, and the budget is checked before anything is allocated, so a budget that is
too small fails with :class:`~vecstore.errors.CapacityError` then, never in the middle of
a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from vecstore.errors import CapacityError
from vecstore.kvstore.row_transfer import copy_across, host_writes_together
from vecstore.registry import Registry

__all__ = ["KVStore", "StoredRows", "KVSTORES", "MemoryAccount", "make_kvstore", "copy_rows",
           "growable_rows", "batch_rows", "shape_bytes"]


@dataclass(frozen=True, slots=True)
class StoredRows:
    """One layer's rows placed in a tier.

    Attributes
    ----------
    keys, values : torch.Tensor
        ``[B, Hkv, N, D]`` cluster-contiguous rows, in the tier's memory.
    num_bytes : int
        Bytes charged to the tier for them.
    """

    keys: torch.Tensor
    values: torch.Tensor
    num_bytes: int


class MemoryAccount:
    """Bytes in use and at peak under a budget (``0`` = unbounded).

    Examples
    --------
    >>> acct = MemoryAccount(100, "pinned")
    >>> acct.charge(60); acct.release(60); acct.charge(90)
    >>> acct.used_bytes, acct.peak_bytes
    (90, 90)
    >>> acct.charge(20, "layer 0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vecstore.errors.CapacityError: pinned: layer 0 needs 20 more bytes (...), over the budget \
of 100 (...) with 90 (...) in use; raise the budget
    """

    def __init__(self, budget_bytes: int, name: str) -> None:
        self.budget_bytes = budget_bytes
        self.name = name
        self.used_bytes = 0
        self.peak_bytes = 0

    def can_charge(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more fit in the budget."""
        return self.budget_bytes == 0 or self.used_bytes + num_bytes <= self.budget_bytes

    def charge(self, num_bytes: int, what: str = "") -> None:
        """Account for ``num_bytes`` more, or raise :class:`CapacityError` and change nothing.

        ``what`` names the request in the error (e.g. ``"layer 3 of 'doc'"``).
        """
        if not self.can_charge(num_bytes):
            raise CapacityError(
                f"{self.name}: {what or 'the request'} needs {num_bytes} more bytes "
                f"({_gib(num_bytes)}), over the budget of {self.budget_bytes} "
                f"({_gib(self.budget_bytes)}) with {self.used_bytes} "
                f"({_gib(self.used_bytes)}) in use; raise the budget")
        self.used_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, num_bytes: int) -> None:
        """Return ``num_bytes`` to the budget."""
        assert num_bytes <= self.used_bytes, "released more bytes than charged"
        self.used_bytes -= num_bytes


@runtime_checkable
class KVStore(Protocol):
    """A memory tier for KV rows, registered by kind in :data:`KVSTORES`.

    A tier says what it is through :attr:`resident`, and a store's
    :class:`~vecstore.kvstore.placement.Placement` builds it accordingly (see
    :func:`make_kvstore`):

    - a *resident* tier keeps a layer's rows on the layer's device. One is built per device
      as ``cls(device, budget_gb=..., account=...)``, charging that device's
      ``kvstore.gpu_budget_gb`` account;
    - an *offload* tier keeps the rows of every layer in one memory of its own (on
      :attr:`device`), read from there by the executor. One is built per store as
      ``cls(budget_gb=...)``, under ``kvstore.pinned_budget_gb``.
    """

    resident: ClassVar[bool]
    """Whether rows live on the layer's device (else in the tier's own memory)."""

    shareable_rows: ClassVar[bool]
    """Whether a layer may swap its rows for its batch row of a stacked copy of them (one
    copy of a batch's KV, not two): the stack's rows are :meth:`split`, each layer takes
    its part (and its charge) and frees its own rows. Only where ``free`` of a part leaves
    the memory other parts read, and :meth:`extend` of a part keeps it where it is or
    moves it out whole (a tier growing rows in place grows a part within its heads of the
    stack's reserve, so the stack reads the rows the layer grew)."""

    device: torch.device
    """Where the tier's rows live."""

    @property
    def account(self) -> MemoryAccount:
        """Bytes in use and at peak, and the budget."""
        ...

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype,
                 what: str = "") -> StoredRows:
        """Uninitialised key and value tensors of ``shape`` in the tier.

        Raises
        ------
        CapacityError
            They do not fit in the budget; nothing is allocated.
        """
        ...

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> StoredRows:
        """Copy ``[B, Hkv, N, D]`` rows into the tier.

        Raises
        ------
        CapacityError
            The rows do not fit in the budget; nothing is allocated.
        """
        ...

    def extend(self, rows: StoredRows, num_rows: int, what: str = "", *,
               room: int = 0) -> StoredRows | None:
        """``[..., N, D]`` rows of this tier with room for ``num_rows >= N`` rows along
        ``N``, the first ``N`` kept and the rest uninitialised; each ``[num_rows, D]`` block
        contiguous (the blocks may sit further apart than ``num_rows`` rows). The result
        replaces ``rows``, which must not be used or freed after. ``None`` where the tier
        does not grow rows (the caller allocates anew and copies); a layer whose index
        grows segment by segment then copies its rows each time. ``room``: rows the caller
        expects them to reach soon, which a tier growing rows in place sizes its reserve
        for as it would for ``num_rows`` (nothing more is charged).

        Raises
        ------
        CapacityError
            The rows added do not fit in the budget; ``rows`` are unchanged.
        """
        ...

    def split(self, rows: StoredRows) -> list[StoredRows]:
        """``[B, ...]`` rows as the ``B`` rows ``rows[b]`` (views, no copy), the charge
        divided evenly between them; each is freed and extended on its own after. The
        result replaces ``rows``, which must not be used or freed after."""
        ...

    def free(self, rows: StoredRows) -> None:
        """Release rows placed by :meth:`store`, :meth:`allocate`, :meth:`extend` or
        :meth:`split`."""
        ...


KVSTORES: Registry[type] = Registry("kvstore")
"""Tiers by kind (config key ``kvstore.kind``): ``memory`` and ``pinned``."""


def make_kvstore(kind: str, *, device: str | torch.device = "cpu", budget_gb: float = 0.0,
                 account: MemoryAccount | None = None) -> KVStore:
    """Build the tier registered as ``kind``.

    Parameters
    ----------
    kind : str
        A name from ``KVSTORES.names()``, as given in ``kvstore.kind``.
    device : str | torch.device
        Where a resident tier keeps its rows; an offload tier ignores it.
    budget_gb : float
        The tier's budget in GiB (0 = unbounded) when it has no ``account``.
    account : MemoryAccount, optional
        The account a resident tier charges (a store's per-device account); an offload
        tier keeps an account of its own.

    Raises
    ------
    ConfigError
        ``kind`` is not registered; the message lists the known kinds.

    Examples
    --------
    >>> make_kvstore("memory", device="cpu").device, make_kvstore("pinned").resident
    (device(type='cpu'), False)
    """
    cls = KVSTORES.get(kind)
    if cls.resident:
        return cls(device, budget_gb=budget_gb, account=account)  # type: ignore[no-any-return]
    return cls(budget_gb=budget_gb)  # type: ignore[no-any-return]


def copy_rows(tier: KVStore, keys: torch.Tensor, values: torch.Tensor) -> StoredRows:
    """:meth:`KVStore.store` through :meth:`KVStore.allocate`: a copy of ``keys, values`` in
    ``tier``, never a view of the caller's tensors."""
    rows = tier.allocate(tuple(keys.shape), keys.dtype, f"rows {tuple(keys.shape)}")
    with host_writes_together():
        copy_across(keys, rows.keys)
        copy_across(values, rows.values)
    return rows


def growable_rows(tier: KVStore, shape: tuple[int, ...], dtype: torch.dtype,
                  what: str = "", *, room: int = 0) -> StoredRows:
    """Uninitialised ``[..., N, D]`` rows of ``shape`` in ``tier``, to be grown by
    :meth:`KVStore.extend`: where the tier grows rows they are grown from no rows, so a tier
    that grows them in place does so from their first growth on (the ``pinned`` tier
    reserves address space for more, sized for ``room`` rows if more than ``N``, and
    commits, pins and charges only these); elsewhere :meth:`KVStore.allocate`.

    Raises
    ------
    CapacityError
        They do not fit in the budget; nothing is allocated.
    """
    empty = tier.allocate((*shape[:-2], 0, shape[-1]), dtype, what)
    try:
        rows = tier.extend(empty, shape[-2], what, room=room)
    except BaseException:
        tier.free(empty)
        raise
    if rows is None:
        tier.free(empty)
        rows = tier.allocate(shape, dtype, what)
    return rows


def batch_rows(rows: StoredRows) -> list[StoredRows]:
    """``[B, ...]`` rows as the ``B`` views ``rows[b]``, the charge divided evenly: the
    common part of :meth:`KVStore.split`."""
    B = rows.keys.shape[0]
    return [StoredRows(rows.keys[b], rows.values[b], rows.num_bytes // B) for b in range(B)]


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a key and a value tensor of ``shape`` and ``dtype``."""
    n = 1
    for d in shape:
        n *= d
    return 2 * n * torch.empty((), dtype=dtype).element_size()


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"

