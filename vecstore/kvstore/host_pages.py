"""Host memory of its own for the pinned tier: anonymous mappings, registered with CUDA
(page-locked and mapped into the GPU's address space) range by range.

A :class:`HostPages` is one anonymous mapping viewed as a 1-D tensor. Untouched pages
cost address space only, so a mapping may be reserved larger than its rows and grown into:
:meth:`HostPages.pin` registers a further range as rows reach it, after faulting its pages
in from several threads (:func:`fault_in`): ``cudaHostRegister`` of untouched pages faults
and zeroes them one by one inside the call, the most of a pinned prefill's extra time
(``benchmarks/host_pages.py``); :meth:`HostPages.fault_ahead` faults a range expected next
in on a background thread, while the GPU computes. Registrations last exactly
as long as some tensor views the mapping, and are undone before it is unmapped: a range
unmapped while registered could be mapped again at the same addresses, which CUDA then
refuses to register (``cudaErrorHostMemoryAlreadyRegistered``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vecstore.errors import CapacityError

__all__ = ["HostPages", "fault_in", "page_multiple"]

_MADV_POPULATE_WRITE = 23  # Linux 5.14
# ranges are faulted in parts of at least this many bytes, each on a thread of its own
_FAULT_PART = 4 << 20
_FAULT_THREADS = min(8, os.cpu_count() or 1)  # 0: no faulting ahead of the registration
# private anonymous memory (mmap's default, shared, is shmem); under madvise the two fault
# in about as fast (benchmarks/results/host_pages.md). Reserved, not committed: only pages
# faulted in count against the host's memory
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(
    mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)  # Python 3.13 names it


def page_multiple(num_bytes: int) -> int:
    """``num_bytes`` rounded up to whole pages."""
    return -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


class HostPages:
    """One anonymous, page-aligned mapping that no other allocation shares, and what of it is
    registered with CUDA. Holds no reference to the memory: :meth:`map` returns the tensor
    that does, and the mapping goes (unregistered, then unmapped) with the last view of it.

    Examples
    --------
    >>> pages, memory = HostPages.map(3 * mmap.PAGESIZE, register=False)
    >>> memory.numel() == 3 * mmap.PAGESIZE, memory.data_ptr() % mmap.PAGESIZE, pages.alive
    (True, 0, True)
    >>> del memory; pages.alive
    False
    """

    def __init__(self, base: int, register: bool, pinned: list[int],
                 finalizer: weakref.finalize) -> None:
        self.base = base
        self.register = register
        self._pinned = pinned  # base addresses of the registered ranges
        self._finalizer = finalizer
        self._ahead: list[Future[bool]] = []  # jobs faulting ranges in in the background

    @classmethod
    def map(cls, num_bytes: int, *, register: bool,
            dtype: torch.dtype = torch.uint8) -> tuple[HostPages, torch.Tensor]:
        """A new mapping of ``num_bytes`` (a multiple of ``dtype``'s size) and the 1-D
        ``dtype`` tensor over it (``register``: whether :meth:`pin` registers with CUDA;
        ``False`` where CUDA is absent)."""
        mapping = mmap.mmap(-1, num_bytes, flags=_MAP_FLAGS)
        exported = memoryview(mapping)
        # a normal tensor even under torch.inference_mode (its views then are too): rows
        # placed in a prompt's inference-mode prefill grow in place later, whatever mode
        # the decoding runs in
        with torch.inference_mode(False):
            memory = torch.frombuffer(exported, dtype=dtype)
        pinned: list[int] = []
        # the finalizer holds the mapping, so it is unmapped only after the unregisters
        finalizer = weakref.finalize(exported, _unpin, pinned, mapping)
        return cls(memory.data_ptr(), register, pinned, finalizer), memory

    @property
    def alive(self) -> bool:
        """Whether some tensor still views the mapping."""
        return self._finalizer.alive

    @property
    def num_pinned(self) -> int:
        """Ranges registered now (none once the mapping is gone)."""
        return len(self._pinned)

    def fault_ahead(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Fault the ``(offset, num_bytes)`` ranges of the mapping in on a background thread
        (:func:`fault_in`; nothing is registered), so that a later :meth:`pin` of them only
        registers. The job holds the mapping until it is done; :meth:`settle` waits for it.
        Pages faulted in ahead are committed host memory until the mapping goes."""
        held = self._finalizer.peek()
        ranges = [(self.base + offset, n) for offset, n in ranges if n > 0]
        if held is None or not ranges:
            return
        self._ahead = [job for job in self._ahead if not job.done()]
        self._ahead.append(_ahead_pool().submit(_fault_held, held[0], ranges))

    def settle(self) -> None:
        """Wait for the ranges :meth:`fault_ahead` asked for to be faulted in."""
        while self._ahead:
            self._ahead.pop().result()

    def pin(self, offset: int, num_bytes: int, *, fault: bool = True) -> None:
        """Register ``[offset, offset + num_bytes)`` of the mapping (whole pages, none
        registered before), its pages faulted in first (:func:`fault_in`) unless ``fault``
        is ``False`` (the caller did); nothing is registered on failure.

        Raises
        ------
        CapacityError
            CUDA refused (out of page-locked memory); no error is left pending.
        """
        if not (self.register and num_bytes):
            return
        ptr = self.base + offset
        if fault:
            fault_in([(ptr, num_bytes)])
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, num_bytes, 0))
        if err != 0:
            _clear_pending_error()
            raise CapacityError(f"kvstore.pinned_budget_gb: could not pin {num_bytes} bytes "
                                f"({torch.cuda.CudaError(err)})")
        self._pinned.append(ptr)


def fault_in(ranges: Sequence[tuple[int, int]]) -> bool:
    """Commit the pages of each ``(addr, num_bytes)`` range (whole pages of anonymous
    mappings) by faulting them in for writing: ``madvise(MADV_POPULATE_WRITE)`` of parts of
    ``_FAULT_PART`` bytes or more, all at once on up to ``_FAULT_THREADS`` threads, the GIL
    released. Contents are kept. ``False`` where nothing was done (no such ``madvise``: not
    Linux, or a kernel older than 5.14; or ``_FAULT_THREADS`` is 0) or some pages could not
    be faulted in (out of memory): those are left to whatever touches them next.

    Examples
    --------
    >>> pages, memory = HostPages.map(4 * mmap.PAGESIZE, register=False)
    >>> fault_in([(pages.base, mmap.PAGESIZE), (pages.base + 2 * mmap.PAGESIZE, 8192)]) in (
    ...     True, False)
    True
    """
    madvise = _madvise()
    if madvise is None or _FAULT_THREADS < 1:
        return False
    total = sum(n for _, n in ranges)
    step = max(_FAULT_PART, page_multiple(-(-total // _FAULT_THREADS)))
    parts = [(addr + o, min(step, n - o), _MADV_POPULATE_WRITE)
             for addr, n in ranges for o in range(0, n, step)]
    if len(parts) <= 1:
        return all(madvise(*part) == 0 for part in parts)
    return all(r == 0 for r in _fault_pool().map(lambda part: madvise(*part), parts))


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` where ``MADV_POPULATE_WRITE`` works, else ``None``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    probe = torch.frombuffer(memoryview(mmap.mmap(-1, mmap.PAGESIZE)), dtype=torch.uint8)
    return fn if fn(probe.data_ptr(), mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0 else None


@functools.cache
def _fault_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_FAULT_THREADS, thread_name_prefix="vecstore-fault")


@functools.cache
def _ahead_pool() -> ThreadPoolExecutor:
    # one thread: jobs run in order, each spreading its ranges over the fault pool
    return ThreadPoolExecutor(1, thread_name_prefix="vecstore-fault-ahead")


def _fault_held(held: object, ranges: list[tuple[int, int]]) -> bool:
    # ``held`` (the mapping's exported buffer) keeps the ranges mapped until they are done
    return fault_in(ranges)


def _unpin(pinned: list[int], mapping: mmap.mmap) -> None:
    # ``mapping`` is passed only to be held until now
    for ptr in pinned:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    pinned.clear()


def _clear_pending_error() -> None:
    # a failed runtime call leaves its error for the next check, which torch makes after its
    # next kernel launch: make that check here, so the failure does not surface elsewhere
    try:
        torch.ones(1, device="cuda").add_(1)
    except torch.AcceleratorError:
        pass
