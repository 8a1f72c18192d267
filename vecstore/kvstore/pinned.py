"""Pinned host tier (``pinned``), an offload tier: the whole KV in page-locked CPU memory,
read by the GPU over PCIe.

Page-locked memory is mapped into the GPU's address space (unified addressing), so copy
kernels read a step's missed clusters from it directly, without a staging copy.
"""

from __future__ import annotations

import mmap
import weakref

import torch

from vecstore.errors import CapacityError
from vecstore.kvstore.base import KVSTORES, MemoryAccount, StoredRows, copy_rows, shape_bytes

__all__ = ["PinnedKVStore"]


def _page_aligned(num_bytes: int) -> tuple[torch.Tensor, mmap.mmap, memoryview]:
    """``num_bytes`` of anonymous, page-aligned memory that no other allocation shares; the
    tensor views the mapping through the memoryview, which lives exactly as long as the
    tensor and every view of it."""
    mapping = mmap.mmap(-1, num_bytes)
    exported = memoryview(mapping)
    return torch.frombuffer(exported, dtype=torch.uint8), mapping, exported


def _pinned(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` of page-locked host memory of its own, registered with CUDA until the
    last tensor viewing it goes, and unregistered before it is unmapped: a range unmapped
    while registered could be mapped again at the same addresses, which CUDA then refuses
    to register (cudaErrorHostMemoryAlreadyRegistered)."""
    host, mapping, exported = _page_aligned(num_bytes)
    err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), num_bytes, 0))
    if err != 0:
        _clear_pending_error()
        raise CapacityError(f"kvstore.pinned_budget_gb: could not pin {num_bytes} bytes "
                            f"({torch.cuda.CudaError(err)})")
    # the finalizer holds the mapping, so it is unmapped only after the unregister
    weakref.finalize(exported, _unpin, host.data_ptr(), mapping)
    return host


def _unpin(ptr: int, mapping: mmap.mmap) -> None:
    # ``mapping`` is passed only to be held until now
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _clear_pending_error() -> None:
    # a failed runtime call leaves its error for the next check, which torch makes after its
    # next kernel launch: make that check here, so the failure does not surface elsewhere
    try:
        torch.ones(1, device="cuda").add_(1)
    except torch.AcceleratorError:
        pass


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
                out.append(_pinned(num_bytes // 2).view(dtype).view(shape))
        except BaseException:
            out.clear()  # unpinned and unmapped now
            self._account.release(num_bytes)
            raise
        return StoredRows(out[0], out[1], num_bytes)

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> StoredRows:
        return copy_rows(self, keys, values)

    def free(self, rows: StoredRows) -> None:
        # the pages stay pinned while anything (a copy in flight, a captured graph's
        # arguments) still views them; they are unpinned and unmapped when nothing does
        self._account.release(rows.num_bytes)
