"""One row's stored prefix and new tokens as one key and one value tensor on the device.

A prefill chunk attends to every token its row stores (:meth:`vecstore.Sequence.kv_blocks`:
indexed rows, sinks, tail) and to its own tokens in one attention call, so each row's
blocks are copied into one ``[Hkv, S, D]`` pair, the new tokens last. Blocks held
elsewhere (rows in pinned host memory, ``kvstore.kind = "pinned"``) are copied on a side
CUDA stream one row ahead: the copy of row ``b + 1`` runs while row ``b`` is attended.
Pinned rows are read by a kernel (:func:`vecstore.kvstore.row_transfer.copy_across`), not by
DMA copies, which must each lie within one registration of the host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import torch

from vecstore.kvstore.row_transfer import copy_across

__all__ = ["Blocks", "rows_on_device"]

Blocks = list[tuple[torch.Tensor, torch.Tensor]]
"""``[Hkv, n, D]`` key and value blocks, in the order they are laid out."""


def rows_on_device(rows: list[Blocks], device: torch.device,
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's blocks concatenated on ``device``, row by row.

    Parameters
    ----------
    rows : list[Blocks]
        One list of blocks per row (at least one block each).
    device : torch.device
        Where the attention runs.

    Yields
    ------
    tuple[torch.Tensor, torch.Tensor]
        ``[Hkv, S, D]`` keys and values of the row, ready on the current stream. A row
        of one block already on ``device`` is yielded as is, without a copy.

    Examples
    --------
    >>> a, b = torch.ones(2, 3, 4), torch.zeros(2, 1, 4)
    >>> [tuple(k.shape) for k, _ in rows_on_device([[(a, a), (b, b)], [(b, b)]], a.device)]
    [(2, 4, 4), (2, 1, 4)]
    """
    side = None
    if device.type == "cuda" and any(k.device != device for blocks in rows for k, _ in blocks):
        side = _side_stream(device)
    try:
        ahead = _gather(rows[0], device, side) if rows else None
        for i in range(len(rows)):
            keys, values, ready = ahead  # type: ignore[misc]
            # the next row's host copy is issued before this row is attended: they overlap
            ahead = _gather(rows[i + 1], device, side) if i + 1 < len(rows) else None
            if ready is not None:
                torch.cuda.current_stream(device).wait_event(ready)
            yield keys, values
    finally:
        if side is not None:
            side.synchronize()  # the host rows may be re-placed or freed once we return


def _gather(blocks: Blocks, device: torch.device, side: torch.cuda.Stream | None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """Copy ``blocks`` into one new pair on ``device``; host blocks go through ``side``
    (and the event to wait for before reading is returned)."""
    k0, v0 = blocks[0]
    H, _, D = k0.shape
    if len(blocks) == 1 and k0.device == device:
        return k0, v0, None
    S = sum(k.shape[1] for k, _ in blocks)
    keys = torch.empty(H, S, D, dtype=k0.dtype, device=device)
    values = torch.empty(H, S, D, dtype=v0.dtype, device=device)
    ready, pos = None, 0
    if side is not None:
        # the new pair may reuse memory the current stream is still reading
        side.wait_stream(torch.cuda.current_stream(device))
    for k, v in blocks:
        n = k.shape[1]
        if side is not None and k.device != device:
            with torch.cuda.stream(side):
                copy_across(k, keys[:, pos:pos + n])
                copy_across(v, values[:, pos:pos + n])
            ready = side.record_event()
        else:
            keys[:, pos:pos + n].copy_(k)
            values[:, pos:pos + n].copy_(v)
        pos += n
    return keys, values, ready


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
