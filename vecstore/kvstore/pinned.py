"""Pinned host tier (``pinned``), an offload tier: the whole KV in page-locked CPU memory,
read by the GPU over PCIe.

Page-locked memory is mapped into the GPU's address space (unified addressing), so copy
kernels read a step's missed clusters from it directly, without a staging copy.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, replace

import torch

from vecstore.errors import InvalidValueError
from vecstore.kvstore.base import (
    KVSTORES,
    MemoryAccount,
    StoredRows,
    batch_rows,
    copy_rows,
    shape_bytes,
)
from vecstore.kvstore.host_pages import HostPages, fault_in, page_multiple

__all__ = ["PinnedKVStore"]


# A layer grown in place (:meth:`PinnedKVStore.extend`) reserves address space for this many
# times its rows; pages are committed and pinned only as rows reach them. Growing past the
# reserve moves the rows into a new one, registering fresh pages for them again: a 128K
# prompt indexed in segments of 8K first grows from 16K rows, so it stays in its first
# reserve (with 4, its rows moved once at 64K and 1.44 times its rows were registered)
_RESERVE = 16


@dataclass(frozen=True, slots=True)
class _Reserve:
    """Rows grown in place: heads ``[head0, head0 + heads)`` of a mapping of ``[*, cap, D]``
    keys and values. ``pinned`` records, per mapping and head, how many bytes from the
    head's start are registered: shared by every reserve of the mapping (a stack and the
    batch rows :meth:`PinnedKVStore.split` made of it), so no range is registered twice."""

    pages: tuple[HostPages, HostPages]
    heads: int
    cap: int
    row_bytes: int
    pinned: tuple[list[int], list[int]]
    head0: int = 0

    def pin_rows(self, num_rows: int) -> None:
        """Register every head's rows up to ``num_rows`` (whole pages), then, where they
        grew (not on their first registration), fault the next growth of the same size in on
        a background thread: rows grow by segments of one size, and faulting is most of what
        registering fresh pages costs (:meth:`HostPages.fault_ahead`)."""
        head_bytes = self.cap * self.row_bytes
        target = min(page_multiple(num_rows * self.row_bytes), head_bytes)
        grow = [(pages, done, h) for pages, done in zip(self.pages, self.pinned, strict=True)
                for h in range(self.head0, self.head0 + self.heads) if target > done[h]]
        for pages in self.pages:
            pages.settle()
        # every range's pages faulted in together (those faulted in ahead cost little), then
        # each registered
        fault_in([(pages.base + h * head_bytes + done[h], target - done[h])
                  for pages, done, h in grow if pages.register])
        ahead = []
        for pages, done, h in grow:
            pages.pin(h * head_bytes + done[h], target - done[h], fault=False)
            if done[h]:
                ahead.append((pages, h * head_bytes + target,
                              min(target - done[h], head_bytes - target)))
            done[h] = target
        for pages in self.pages:
            if pages.register:
                pages.fault_ahead([(offset, n) for p, offset, n in ahead if p is pages])

    def part(self, b: int, parts: int) -> _Reserve:
        """The reserve of batch row ``b`` of ``parts`` (its ``heads // parts`` heads)."""
        heads = self.heads // parts
        return replace(self, heads=heads, head0=self.head0 + b * heads)


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
    shareable_rows = True  # split rows grow in place within their part of the reserve

    def __init__(self, *, budget_gb: float = 0.0) -> None:
        self._account = MemoryAccount(int(budget_gb * 2**30), "kvstore.pinned_budget_gb")
        self.is_pinned = torch.cuda.is_available()
        self.device = torch.device("cpu")
        # rows grown in place, by their keys' address and heads (a stack's batch row 0
        # starts where the stack does)
        self._reserves: dict[tuple[int, int], _Reserve] = {}

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
                    # a normal tensor under inference_mode, as HostPages.map's
                    with torch.inference_mode(False):
                        out.append(torch.empty(shape, dtype=dtype))
                    continue
                # register pages of our own in place: torch's pinned allocator would round
                # each tensor up to a power of two, nearly doubling a large layer's pinned
                # memory, and heap memory may share a page with a range already registered
                pages, memory = HostPages.map(num_bytes // 2, register=True, dtype=dtype)
                pages.pin(0, page_multiple(num_bytes // 2))
                out.append(memory.view(shape))
        except BaseException:
            out.clear()  # unpinned and unmapped now
            self._account.release(num_bytes)
            raise
        return StoredRows(out[0], out[1], num_bytes)

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> StoredRows:
        return copy_rows(self, keys, values)

    def extend(self, rows: StoredRows, num_rows: int, what: str = "", *,
               room: int = 0) -> StoredRows:
        """``rows`` with room for ``num_rows`` rows a head, the first ones kept: in place
        within the rows' reserve of address space, else moved once into a new reserve of
        ``_RESERVE`` times the rows, or times ``room`` if more (only pages rows reach are
        committed and pinned). Each head's rows stay contiguous; heads sit a reserve apart.
        ``rows`` are consumed."""
        *lead, n_old, dim = rows.keys.shape
        if num_rows < n_old:
            raise InvalidValueError(f"num_rows: expected >= the {n_old} rows held, got "
                                    f"{num_rows}")
        dtype, heads = rows.keys.dtype, math.prod(lead)
        res = self._reserves.get((rows.keys.data_ptr(), heads))
        if res is not None and res.pages[0].alive and num_rows <= res.cap:
            delta = shape_bytes((*lead, num_rows - n_old, dim), dtype)
            self._account.charge(delta, what)
            try:
                res.pin_rows(num_rows)  # what was registered stays recorded
            except BaseException:
                self._account.release(delta)
                raise
            grown = [x.as_strided((*lead, num_rows, dim), x.stride())
                     for x in (rows.keys, rows.values)]
            return StoredRows(grown[0], grown[1], rows.num_bytes + delta)
        num_bytes = shape_bytes((*lead, num_rows, dim), dtype)
        self._account.charge(num_bytes, what)
        try:
            row_bytes = dim * rows.keys.element_size()
            step = mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, row_bytes)  # heads page-aligned
            cap = -(-_RESERVE * max(num_rows, room, 1) // step) * step
            mapped = [HostPages.map(heads * cap * row_bytes, register=self.is_pinned,
                                    dtype=dtype)
                      for _ in range(2)]
            res = _Reserve((mapped[0][0], mapped[1][0]), heads, cap, row_bytes,
                           ([0] * heads, [0] * heads))
            res.pin_rows(num_rows)
            grown = [memory.view(*lead, cap, dim)[..., :num_rows, :]
                     for _, memory in mapped]
            for new, old in zip(grown, (rows.keys, rows.values), strict=True):
                new[..., :n_old, :].copy_(old)
        except BaseException:
            self._account.release(num_bytes)
            raise
        self.free(rows)
        self._reserves[(grown[0].data_ptr(), heads)] = res
        return StoredRows(grown[0], grown[1], num_bytes)

    def split(self, rows: StoredRows) -> list[StoredRows]:
        """``[B, ...]`` rows as ``B`` rows ``rows[b]``, each charged its part and, where
        ``rows`` grow in place, growing in place within its heads of their reserve.
        ``rows`` are consumed."""
        B, heads = rows.keys.shape[0], math.prod(rows.keys.shape[:-2])
        res = self._reserves.pop((rows.keys.data_ptr(), heads), None)
        parts = batch_rows(rows)
        if res is not None and res.pages[0].alive:
            for b, part in enumerate(parts):
                self._reserves[(part.keys.data_ptr(), heads // B)] = res.part(b, B)
        return parts

    def free(self, rows: StoredRows) -> None:
        # the pages stay pinned while anything (a copy in flight, a captured graph's
        # arguments, another batch row of a split stack) still views them; they are
        # unpinned and unmapped when nothing does
        self._reserves.pop((rows.keys.data_ptr(), math.prod(rows.keys.shape[:-2])), None)
        self._account.release(rows.num_bytes)
