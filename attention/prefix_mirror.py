"""Offloaded rows' stored prefixes kept on the device across a prompt's prefill chunks.

Each prefill chunk attends to its rows' whole stored prefix
(:meth:`vecstore.Sequence.kv_blocks`). Rows whose KV tier is not resident
(``kvstore.kind = "pinned"``) would cross PCIe whole again every chunk; a
:class:`PrefixMirror` keeps, per sequence and layer, a copy of the row's stored tokens on
the device where the attention runs, to which each chunk appends its valid new tokens.
The prefix is attended without a mask, so the mirror holds the stored tokens in arrival
order, not in the store's. An entry is used only while it holds as many tokens as the
sequence stores in that layer (:meth:`vecstore.Sequence.tokens`): otherwise (an ingestion
that failed, tokens appended or rolled back elsewhere) it is rebuilt from ``kv_blocks``,
one copy. Memory is bounded (``attention.prefill_mirror_gb``): a row whose mirror does
not fit gets none, and its chunks read the tier as before. Unset, the bound is the
device's: a growth leaves free a quarter of the memory the device had available when the
prompt's first chunk reached the mirror (:func:`available_bytes`), whatever else the
prefill allocated since; off on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.prefix import pack_blocks
from vecstore import Sequence

__all__ = ["PrefixMirror", "available_bytes"]

HEADROOM = 0.25
"""Share of the memory available at a prompt's start an unbounded mirror leaves free."""


def available_bytes(device: torch.device) -> int:
    """Device memory a new tensor could take on ``device``: what the CUDA driver reports
    free plus what torch's allocator holds unused; 0 on a device that is not CUDA.

    Examples
    --------
    >>> available_bytes(torch.device("cpu"))
    0
    """
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


@dataclass(slots=True)
class _Entry:
    """``[Hkv, cap, D]`` keys and values, the first ``count`` tokens held."""

    keys: torch.Tensor
    values: torch.Tensor
    count: int

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class PrefixMirror:
    """Device copies of rows' stored tokens, per (sequence, layer), grown as chunks arrive.

    Parameters
    ----------
    max_bytes : int | None
        The most bytes of keys and values the mirror holds (capacity included); 0 holds
        nothing. ``None``: the devices' memory, each growth leaving free
        :data:`HEADROOM` of what its device had available (:func:`available_bytes`) at
        the prompt's first growth there (after construction or :meth:`clear`).

    Examples
    --------
    >>> from vecstore import Store
    >>> with Store.open() as store:
    ...     seq = store.create("m", num_layers=1, num_kv_heads=2, head_dim=8,
    ...                        dtype=torch.float32)
    ...     mirror = PrefixMirror(1 << 20)
    ...     k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    ...     keys, _ = mirror.extend(seq, 0, k, v)      # nothing stored yet: the chunk alone
    ...     seq.append(0, k, v)                        # the chunk is ingested
    ...     keys, _ = mirror.extend(seq, 0, k[:, :2], v[:, :2])  # the next chunk
    >>> keys.shape, mirror.held_bytes > 0
    (torch.Size([2, 7, 8]), True)
    >>> mirror.clear(); mirror.held_bytes
    0
    """

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[tuple[Sequence, int], _Entry] = {}
        self._held = 0
        # per device, the bytes a growth leaves available there (unbounded)
        self._keep_free: dict[torch.device, int] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes of keys and values the mirror holds now (capacity included)."""
        return self._held

    def extend(self, seq: Sequence, layer: int, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``seq``'s stored tokens of ``layer`` followed by new ones, as one block.

        Parameters
        ----------
        seq : Sequence
            A batch row.
        layer : int
            Layer index.
        keys, values : torch.Tensor
            ``[Hkv, n, D]`` the row's valid new tokens, on the device the attention runs
            on (where the mirror is kept). The mirror holds them from now on: it expects
            ``seq`` to store them before the next call.

        Returns
        -------
        tuple[torch.Tensor, torch.Tensor] | None
            ``[Hkv, S + n, D]`` key and value views of the mirror: the ``S`` stored tokens
            (in any order) then the new ones, in order. ``None`` when they do not fit in
            ``max_bytes`` or in the device's memory; the row's entry is dropped then.
        """
        entry = self._pop((seq, layer))
        stored = seq.tokens(layer)
        if entry is not None and (entry.count != stored or entry.keys.device != keys.device):
            entry = None  # stale: rebuilt from what the sequence stores
        start = stored if entry is None else entry.count
        need = start + keys.shape[1]
        grown = self._room(entry, need, keys)
        if grown is None:
            return None
        if entry is None:
            pack_blocks(seq.kv_blocks(layer) if stored else [], grown.keys, grown.values)
        grown.keys[:, start:need].copy_(keys)
        grown.values[:, start:need].copy_(values)
        grown.count = need
        self._entries[(seq, layer)] = grown
        self._held += grown.nbytes
        return grown.keys[:, :need], grown.values[:, :need]

    def retain(self, seqs: list[Sequence]) -> None:
        """Drop the entries of sequences not in ``seqs``."""
        keep = {id(s) for s in seqs}
        for key in [key for key in self._entries if id(key[0]) not in keep]:
            self._pop(key)

    def clear(self) -> None:
        """Drop every entry (their memory is freed once no attention reads it)."""
        self._entries.clear()
        self._held = 0
        self._keep_free.clear()

    def _pop(self, key: tuple[Sequence, int]) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._held -= entry.nbytes
        return entry

    def _room(self, entry: _Entry | None, need: int, like: torch.Tensor) -> _Entry | None:
        """``entry`` (taken out of the mirror) with room for ``need`` tokens, its held
        tokens kept: itself, or grown (doubling, within ``max_bytes``); a new one when
        ``None``. ``None`` when ``need`` tokens do not fit."""
        if entry is not None and entry.keys.shape[1] >= need:
            return entry
        H, _, D = like.shape
        token_bytes = 2 * H * D * like.element_size()
        room = self._room_bytes(like.device) // token_bytes
        cap = min(max(need, 2 * entry.keys.shape[1]) if entry is not None else need, room)
        if cap < need:
            return None
        try:
            keys = torch.empty(H, cap, D, dtype=like.dtype, device=like.device)
            values = torch.empty_like(keys)
        except torch.OutOfMemoryError:
            return None
        if entry is None:
            return _Entry(keys, values, 0)
        keys[:, :entry.count].copy_(entry.keys[:, :entry.count])
        values[:, :entry.count].copy_(entry.values[:, :entry.count])
        return _Entry(keys, values, entry.count)

    def _room_bytes(self, device: torch.device) -> int:
        """Bytes a growth may take: within ``max_bytes``, or (unbounded) what ``device``
        has available less the headroom decided at the prompt's first growth there."""
        if self.max_bytes is not None:
            return self.max_bytes - self._held
        available = available_bytes(device)
        keep = self._keep_free.setdefault(device, int(HEADROOM * available))
        return available - keep
