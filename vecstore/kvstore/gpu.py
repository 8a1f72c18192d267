"""GPU-resident tier (``memory``): KV rows in the layer's device memory, read in place."""

from __future__ import annotations

import torch

from vecstore.kvstore.base import (
    KVSTORES,
    MemoryAccount,
    StoredRows,
    batch_rows,
    copy_rows,
    shape_bytes,
)

__all__ = ["GPUKVStore"]


@KVSTORES.register("memory")
class GPUKVStore:
    """Rows on the executor's device (``cuda`` or, for tests, ``cpu``).

    Parameters
    ----------
    device : str | torch.device
        Where the rows live.
    budget_gb : float
        Bytes allowed, in GiB; 0 means unbounded.
    account : MemoryAccount, optional
        Charge this account instead of a new one of ``budget_gb`` (a store shares one
        account per device between the rows, the index metadata and the wave buffers).

    Examples
    --------
    >>> kv = GPUKVStore("cpu", budget_gb=1e-5)
    >>> rows = kv.store(torch.zeros(1, 2, 64, 4), torch.zeros(1, 2, 64, 4))
    >>> rows.num_bytes, kv.account.used_bytes
    (4096, 4096)
    >>> kv.free(rows); kv.account.used_bytes
    0
    """

    resident = True
    shareable_rows = True  # free returns the charge; rows are rebuilt, never grown

    def __init__(self, device: str | torch.device = "cpu", *, budget_gb: float = 0.0,
                 account: MemoryAccount | None = None) -> None:
        self.device = torch.device(device)
        self._account = account or MemoryAccount(int(budget_gb * 2**30),
                                                 f"kvstore.gpu_budget_gb on {self.device}")

    @property
    def account(self) -> MemoryAccount:
        return self._account

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype,
                 what: str = "") -> StoredRows:
        num_bytes = shape_bytes(shape, dtype)
        self._account.charge(num_bytes, what)
        try:
            keys = torch.empty(shape, dtype=dtype, device=self.device)
            values = torch.empty(shape, dtype=dtype, device=self.device)
        except BaseException:
            self._account.release(num_bytes)
            raise
        return StoredRows(keys, values, num_bytes)

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> StoredRows:
        return copy_rows(self, keys, values)

    def extend(self, rows: StoredRows, num_rows: int, what: str = "", *,
               room: int = 0) -> None:
        # re-placing on the device copies at its bandwidth; a reserve would hold memory
        return None

    def split(self, rows: StoredRows) -> list[StoredRows]:
        return batch_rows(rows)

    def free(self, rows: StoredRows) -> None:
        self._account.release(rows.num_bytes)
