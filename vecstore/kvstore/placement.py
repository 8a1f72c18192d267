"""A store's placement: which tier its indexed rows go to, and its budget accounts.

``kvstore.kind`` names a tier registered in :data:`~vecstore.kvstore.base.KVSTORES`; the
placement builds it as the tier declares (:class:`~vecstore.kvstore.base.KVStore`). A
resident tier (``memory``) keeps every layer's rows on the layer's device; an offload tier
(``pinned``) puts them in its own memory, charged to ``kvstore.pinned_budget_gb``. Either
way the index metadata (centroids, value sums, sizes, offsets) and the steady zone stay on
the layer's device. ``kvstore.gpu_budget_gb`` is one :class:`MemoryAccount` per device,
charged by the rows of a resident tier, the index metadata and the wave buffers (block
cache and execution buffer) built there.
"""

from __future__ import annotations

import torch

from vecstore.config import KVStoreConfig
from vecstore.errors import CapacityError
from vecstore.kvstore.base import KVSTORES, KVStore, MemoryAccount, make_kvstore

__all__ = ["Placement"]


class Placement:
    """Tiers and per-device accounts of one store.

    Parameters
    ----------
    config : KVStoreConfig
        Kind and budgets.

    Attributes
    ----------
    kind : str
        The configured ``kvstore.kind``.
    offload : KVStore | None
        The store's one tier when ``kind`` is an offload tier; ``None`` for a resident
        kind, whose tiers are built per device by :meth:`tier`.

    Examples
    --------
    >>> from vecstore.config import KVStoreConfig
    >>> p = Placement(KVStoreConfig(kind="pinned", gpu_budget_gb=1.0))
    >>> p.tier("cpu") is p.tier("cuda:0"), p.tier("cuda:0").device
    (True, device(type='cpu'))
    >>> p.device_account("cpu").name
    'kvstore.gpu_budget_gb on cpu'

    Raises
    ------
    ConfigError
        ``config.kind`` names no registered tier; the message lists the known kinds.
    """

    def __init__(self, config: KVStoreConfig) -> None:
        self.kind = config.kind
        self._gpu_bytes = int(config.gpu_budget_gb * 2**30)
        self._accounts: dict[torch.device, MemoryAccount] = {}
        self._tiers: dict[torch.device, KVStore] = {}
        self.offload: KVStore | None = (
            None if KVSTORES.get(config.kind).resident
            else make_kvstore(config.kind, budget_gb=config.pinned_budget_gb))

    def device_account(self, device: str | torch.device) -> MemoryAccount:
        """The ``kvstore.gpu_budget_gb`` account of ``device``."""
        dev = _normal(device)
        acct = self._accounts.get(dev)
        if acct is None:
            acct = self._accounts[dev] = MemoryAccount(self._gpu_bytes,
                                                       f"kvstore.gpu_budget_gb on {dev}")
        return acct

    def tier(self, device: str | torch.device) -> KVStore:
        """The tier holding the rows of a layer that lives on ``device``: the offload tier,
        or the resident tier of ``device`` (its rows on ``tier(device).device``)."""
        if self.offload is not None:
            return self.offload
        dev = _normal(device)
        tier = self._tiers.get(dev)
        if tier is None:
            tier = self._tiers[dev] = make_kvstore(self.kind, device=dev,
                                                   account=self.device_account(dev))
        return tier

    def check_fits(self, rows: list[tuple[torch.device, int]], num_sequences: int) -> None:
        """Refuse (at open) the indexed rows of ``num_sequences`` sequences, ``(device of
        the layer, bytes)`` each, if they cannot fit their tier's budget.

        Raises
        ------
        CapacityError
            Naming the budget, the bytes needed and the budget's size.
        """
        need: dict[str, int] = {}
        accounts: dict[str, MemoryAccount] = {}
        for device, num_bytes in rows:
            acct = self.tier(device).account
            accounts[acct.name] = acct
            need[acct.name] = need.get(acct.name, 0) + num_bytes
        for name, num_bytes in need.items():
            acct = accounts[name]
            if acct.budget_bytes and num_bytes > acct.budget_bytes:
                raise CapacityError(
                    f"{name}: the indexed rows of this store's {num_sequences} sequences "
                    f"need {num_bytes} bytes ({num_bytes / 2**30:.3g} GiB), over the budget "
                    f"of {acct.budget_bytes} ({acct.budget_bytes / 2**30:.3g} GiB); raise "
                    "the budget")

    def accounts(self) -> dict[str, MemoryAccount]:
        """Every account in use, by name."""
        out = {a.name: a for a in self._accounts.values()}
        if self.offload is not None:
            out[self.offload.account.name] = self.offload.account
        return out

    def usage(self) -> dict[str, tuple[int, int, int]]:
        """``(in use, at peak, budget)`` bytes of every account in use, by name."""
        return {name: (a.used_bytes, a.peak_bytes, a.budget_bytes)
                for name, a in self.accounts().items()}


def _normal(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
