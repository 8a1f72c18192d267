"""Pinned host tier (``pinned``), an offload tier: the whole KV in page-locked CPU memory,
read by the GPU over PCIe.

Page-locked memory is mapped into the GPU's address space (unified addressing), so copy
kernels read a step's missed clusters from it directly, without a staging copy.
"""

from __future__ import annotations

import mmap

import torch

from vecstore.errors import CapacityError
from vecstore.kvstore.base import KVSTORES, MemoryAccount, StoredRows, copy_rows, shape_bytes

__all__ = ["PinnedKVStore"]


def _page_aligned(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` of anonymous, page-aligned memory that no other allocation shares."""
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=torch.uint8)


@KVSTORES.register("pinned")
class PinnedKVStore:
    """Rows in pinned host memory (plain host memory where CUDA is absent, for tests).

    Parameters
    ----------
    budget_gb : float
        Pinned bytes allowed, in GiB; 0 means unbounded.

    Examples
    --------
    >>> kv = PinnedKVStore(budget_gb=1e-6)
    >>> rows = kv.store(torch.ones(1, 1, 8, 4), torch.ones(1, 1, 8, 4))
    >>> rows.keys.device.type, kv.account.peak_bytes
    ('cpu', 256)
    >>> kv.store(torch.ones(1, 8, 1024, 4), torch.ones(1, 8, 1024, 4))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vecstore.errors.CapacityError: kvstore.pinned_budget_gb: rows (1, 8, 1024, 4) needs 262144 ...
    """

    resident = False

    def __init__(self, *, budget_gb: float = 0.0) -> None:
        self._account = MemoryAccount(int(budget_gb * 2**30), "kvstore.pinned_budget_gb")
        self.is_pinned = torch.cuda.is_available()
        self.device = torch.device("cpu")

    @property
    def account(self) -> MemoryAccount:
        return self._account

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype,
                 what: str = "") -> StoredRows:
        num_bytes = shape_bytes(shape, dtype)
        self._account.charge(num_bytes, what)
        out: list[torch.Tensor] = []
        try:
            for _ in range(2):
                if not (self.is_pinned and num_bytes):
                    out.append(torch.empty(shape, dtype=dtype))
                    continue
                # register pages of our own in place: torch's pinned allocator would round
                # each tensor up to a power of two, nearly doubling a large layer's pinned
                # memory, and heap memory may share a page with a range already registered
                size = num_bytes // 2
                host = _page_aligned(size).view(dtype).view(shape)
                err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0))
                if err != 0:
                    torch.cuda.cudart().cudaGetLastError()  # not left for torch to report
                    raise CapacityError(f"kvstore.pinned_budget_gb: could not pin {size} "
                                        f"bytes (cudaHostRegister error {err})")
                out.append(host)
        except BaseException:
            if self.is_pinned:
                for x in out:
                    if x.numel():
                        torch.cuda.cudart().cudaHostUnregister(x.data_ptr())
            self._account.release(num_bytes)
            raise
        return StoredRows(out[0], out[1], num_bytes)

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> StoredRows:
        return copy_rows(self, keys, values)

    def free(self, rows: StoredRows) -> None:
        if self.is_pinned:
            for x in (rows.keys, rows.values):
                if x.numel():
                    torch.cuda.cudart().cudaHostUnregister(x.data_ptr())
        self._account.release(rows.num_bytes)
