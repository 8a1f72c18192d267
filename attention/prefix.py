"""Rows' stored prefixes and new tokens packed into key and value tensors on the device.

A prefill chunk attends to every token its rows store (:meth:`vecstore.Sequence.kv_blocks`:
indexed rows, sinks, tail) and to their own tokens, in one attention call per group of
rows (:func:`attention.varlen.varlen_attention`). Each group's rows are copied into one
``[Hkv, T, D]`` pair, row after row, each row's new tokens last; a group holds at most
``attention.prefill_group_gb`` of keys and values (one row at least), and the rows are
split evenly over the fewest groups that fit. Blocks held elsewhere (rows in pinned host memory,
``kvstore.kind = "pinned"``) are copied on a side CUDA stream, a row a group, one row
ahead: the copy of row ``b + 1`` crosses PCIe while row ``b`` is attended (those copies,
not the GPU's occupancy, bound such a prefill). Pinned rows are read by a kernel
(:func:`vecstore.kvstore.row_transfer.copy_across`), not by DMA copies, which must each lie
within one registration of the host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import accumulate

import torch

from vecstore.kvstore.row_transfer import copy_across

__all__ = ["Blocks", "Group", "groups_on_device", "pack_blocks"]

Blocks = list[tuple[torch.Tensor, torch.Tensor]]
"""``[Hkv, n, D]`` key and value blocks, in the order they are laid out."""

@dataclass(frozen=True, slots=True)
class Group:
    """Consecutive rows packed together: row ``rows[i]``'s tokens are
    ``keys[:, offsets[i]:offsets[i + 1]]``."""

    rows: range
    keys: torch.Tensor
    values: torch.Tensor
    offsets: list[int]


def groups_on_device(rows: list[Blocks], device: torch.device, *,
                     max_bytes: int) -> Iterator[Group]:
    """The rows' blocks packed on ``device``, group by group.

    Parameters
    ----------
    rows : list[Blocks]
        One list of blocks per row (at least one block each).
    device : torch.device
        Where the attention runs.
    max_bytes : int
        The most bytes of keys and values a group holds (a larger row alone; 0: every
        row alone); rows with blocks off ``device`` go one a group.

    Yields
    ------
    Group
        ``[Hkv, T, D]`` keys and values of consecutive rows, ready on the current stream.
        A group of one row of one block already on ``device`` is that block, not a copy.

    Examples
    --------
    >>> a, b = torch.ones(2, 3, 4), torch.zeros(2, 1, 4)
    >>> rows = [[(a, a), (b, b)], [(b, b)]]
    >>> [(g.rows, g.offsets) for g in groups_on_device(rows, a.device, max_bytes=1 << 20)]
    [(range(0, 2), [0, 4, 5])]
    >>> [g.rows for g in groups_on_device([[(a, a)], [(a, a)], [(b, b)]], a.device,
    ...                                   max_bytes=200)]
    [range(0, 1), range(1, 2), range(2, 3)]
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    side = None
    if device.type == "cuda" and any(k.device != device for blocks in rows for k, _ in blocks):
        side = _side_stream(device)
    # rows copied from host memory go one a group: PCIe, not the GPU's occupancy, bounds
    # them, and each row's copy then overlaps the attention of the row before
    spans = ([range(i, i + 1) for i in range(len(rows))] if side is not None else
             _spans([_nbytes(blocks) for blocks in rows], max_bytes))
    try:
        ahead = _gather(rows, spans[0], device, side) if spans else None
        for i in range(len(spans)):
            group, ready = ahead  # type: ignore[misc]
            more = i + 1 < len(spans)
            # the next group's host copy is issued before this group is attended: they
            # overlap (rows on the device are copied when their turn comes, so the device
            # holds one group at a time, if the caller drops each before the next)
            ahead = _gather(rows, spans[i + 1], device, side) if side is not None and more else None
            if ready is not None:
                torch.cuda.current_stream(device).wait_event(ready)
            yield group
            del group
            if side is None and more:
                ahead = _gather(rows, spans[i + 1], device, side)
    finally:
        if side is not None:
            side.synchronize()  # the host rows may be re-placed or freed once we return


def _nbytes(blocks: Blocks) -> int:
    return sum(k.nbytes + v.nbytes for k, v in blocks)


def _spans(sizes: list[int], max_bytes: int) -> list[range]:
    """Consecutive rows in the fewest groups of at most ``max_bytes`` (a larger row alone),
    as equal in bytes as that allows."""
    fewest = _fill(sizes, max_bytes)
    if len(fewest) < 2:
        return fewest
    # each row goes to the group its middle byte falls in, groups of equal bytes
    share = sum(sizes) / len(fewest)
    cut, held, marks = [], 0, []
    for size in sizes:
        marks.append(min(len(fewest) - 1, int((held + size / 2) // share)))
        held += size
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or marks[i] != marks[i - 1]:
            cut.append(i)
    even = [range(a, b) for a, b in zip([0, *cut[:-1]], cut, strict=True)]
    fits = all(len(r) == 1 or sum(sizes[i] for i in r) <= max_bytes for r in even)
    return even if fits and len(even) == len(fewest) else fewest


def _fill(sizes: list[int], max_bytes: int) -> list[range]:
    """Consecutive rows, each group filled up to ``max_bytes`` before the next starts."""
    spans, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and held + size > max_bytes:
            spans.append(range(start, i))
            start, held = i, 0
        held += size
    return [*spans, range(start, len(sizes))] if sizes else spans


def _gather(rows: list[Blocks], span: range, device: torch.device,
            side: torch.cuda.Stream | None) -> tuple[Group, torch.cuda.Event | None]:
    """Copy the rows of ``span`` into one new pair on ``device``; host blocks go through
    ``side`` (and the event to wait for before reading is returned)."""
    offsets = list(accumulate((sum(k.shape[1] for k, _ in rows[r]) for r in span), initial=0))
    k0, v0 = rows[span[0]][0]
    if len(span) == 1 and len(rows[span[0]]) == 1 and k0.device == device:
        return Group(span, k0, v0, offsets), None
    H, _, D = k0.shape
    keys = torch.empty(H, offsets[-1], D, dtype=k0.dtype, device=device)
    values = torch.empty(H, offsets[-1], D, dtype=v0.dtype, device=device)
    ready, pos = None, 0
    if side is not None:
        # the new pair may reuse memory the current stream is still reading
        side.wait_stream(torch.cuda.current_stream(device))
    for r in span:
        for block in rows[r]:
            if side is not None and block[0].device != device:
                with torch.cuda.stream(side):
                    pos = pack_blocks([block], keys, values, pos)
                ready = side.record_event()
            else:
                pos = pack_blocks([block], keys, values, pos)
    return Group(span, keys, values, offsets), ready


def pack_blocks(blocks: Blocks, keys: torch.Tensor, values: torch.Tensor, pos: int = 0) -> int:
    """Copy ``blocks`` one after another into ``keys``, ``values`` ``[Hkv, T, D]`` from
    token ``pos`` on, on the current stream (host rows by
    :func:`~vecstore.kvstore.row_transfer.copy_across`); returns where they end."""
    for k, v in blocks:
        n = k.shape[1]
        copy_across(k, keys[:, pos:pos + n])
        copy_across(v, values[:, pos:pos + n])
        pos += n
    return pos


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
