"""Tensors to bytes and back: segment files (safetensors) and steady-zone chunks.

A segment file holds ``keys``, ``values`` (``[Hkv, N, D]``, unit-contiguous),
``offsets`` (``[Hkv, U + 1]`` int64) and one ``meta.<name>`` tensor per index
metadata entry (``[Hkv, U, ...]``). Tensors are read straight out of a copy-on-write
memory map of the file, without a second copy.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass

import torch
from safetensors.torch import save as save_safetensors

from vecstore.catalog.records import ChunkRecord
from vecstore.errors import CorruptionError
from vecstore.index.base import Segment
from vecstore.storage.files import checksum

__all__ = ["SegmentShape", "encode_segment", "decode_segment", "is_intact", "tensor_bytes",
           "encode_chunk", "decode_chunks"]

SEGMENT_FORMAT = "vecstore-segment/1"

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64}


@dataclass(frozen=True, slots=True)
class SegmentShape:
    """What the catalog says a segment file must contain."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    start: int
    end: int
    num_units: int


def encode_segment(seg: Segment) -> bytes:
    """The safetensors bytes of ``seg`` (tensors moved to the CPU).

    The header's metadata carries the checksum of the tensor bytes (``payload``), so a
    file can vouch for itself when it disagrees with its catalog row
    (:func:`is_intact`).
    """
    tensors = {"keys": seg.keys, "values": seg.values, "offsets": seg.offsets,
               **{f"meta.{k}": v for k, v in seg.meta.items()}}
    data = save_safetensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                            metadata={"format": SEGMENT_FORMAT, "start": str(seg.start),
                                      "end": str(seg.end)})
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    payload = memoryview(data)[8 + n:]
    header["__metadata__"]["payload"] = checksum(payload)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors keeps the tensor bytes 8-aligned
    return len(raw).to_bytes(8, "little") + raw + payload


def is_intact(buf: bytes | mmap.mmap) -> bool | None:
    """Whether a segment file's bytes are whole by its own header: its length is what the
    header lays out and its tensor bytes match the header's ``payload`` checksum.
    ``None`` for a file written without that checksum (by an older vecstore)."""
    try:
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(buf[8:8 + n])
        meta = header.pop("__metadata__")
        end = max(int(spec["data_offsets"][1]) for spec in header.values())
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False
    if not isinstance(meta, dict) or "payload" not in meta:
        return None
    return len(buf) == 8 + n + end and checksum(memoryview(buf)[8 + n:]) == meta["payload"]


def decode_segment(buf: mmap.mmap, where: str, want: SegmentShape) -> Segment:
    """Rebuild a segment from a verified file mapping, checking every shape.

    Raises
    ------
    CorruptionError
        Naming ``where`` when the content disagrees with ``want``.
    """
    def bad(msg: str) -> CorruptionError:
        return CorruptionError(f"data file {where} is corrupt: {msg}")

    try:
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(buf[8:8 + n])
        meta = header.pop("__metadata__", {})
        tensors = {name: _tensor(buf, 8 + n, spec) for name, spec in header.items()}
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise bad(f"unreadable safetensors header ({exc})") from None
    if meta.get("format") != SEGMENT_FORMAT:
        raise bad(f"format {meta.get('format')!r}, expected {SEGMENT_FORMAT!r}")
    H, D, N, U = want.num_kv_heads, want.head_dim, want.end - want.start, want.num_units
    for name in ("keys", "values"):
        t = tensors.get(name)
        if t is None or tuple(t.shape) != (H, N, D) or t.dtype != want.dtype:
            raise bad(f"{name} should be ({H}, {N}, {D}) {want.dtype}, found "
                      f"{None if t is None else (tuple(t.shape), t.dtype)}")
    offsets = tensors.get("offsets")
    if offsets is None or tuple(offsets.shape) != (H, U + 1) or offsets.dtype != torch.int64:
        raise bad(f"offsets should be ({H}, {U + 1}) int64")
    if (offsets[:, 0] != 0).any() or (offsets[:, -1] != N).any() or (offsets.diff() < 0).any():
        raise bad(f"offsets must rise from 0 to {N}")
    extra = {k[5:]: v for k, v in tensors.items() if k.startswith("meta.")}
    for k, v in extra.items():
        if tuple(v.shape[:2]) != (H, U):
            raise bad(f"meta.{k} should start with ({H}, {U}), found {tuple(v.shape)}")
    return Segment(start=want.start, end=want.end, keys=tensors["keys"],
                   values=tensors["values"], offsets=offsets, meta=extra)


def _tensor(buf: mmap.mmap, base: int, spec: dict[str, object]) -> torch.Tensor:
    dtype = _DTYPES[str(spec["dtype"])]
    shape = [int(s) for s in spec["shape"]]  # type: ignore[attr-defined]
    lo, hi = (int(x) for x in spec["data_offsets"])  # type: ignore[attr-defined]
    numel = 1
    for s in shape:
        numel *= s
    if lo < 0 or hi - lo != numel * dtype.itemsize or base + hi > len(buf):
        raise ValueError(f"tensor bytes [{lo}, {hi}) do not fit shape {shape}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + lo).reshape(shape)


def tensor_bytes(x: torch.Tensor) -> bytes:
    """The raw bytes of ``x`` in C order (any dtype, moved to the CPU)."""
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_chunk(zone: str, first_token: int, keys: torch.Tensor,
                 values: torch.Tensor) -> ChunkRecord:
    """A steady-zone chunk of ``[Hkv, n, D]`` keys and values."""
    kb, vb = tensor_bytes(keys), tensor_bytes(values)
    return ChunkRecord(zone, first_token, keys.shape[1], kb, vb, checksum(kb, vb))


def decode_chunks(chunks: list[ChunkRecord], num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate chunks (in token order) into ``[Hkv, n, D]`` keys and values.

    Raises
    ------
    CorruptionError
        When a chunk fails its checksum or its size, naming ``where``.
    """
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for c in chunks:
        span = f"{where}, {c.zone} tokens [{c.first_token}, {c.first_token + c.num_tokens})"
        if checksum(c.keys, c.values) != c.checksum:
            raise CorruptionError(f"{span}: steady-zone chunk fails its checksum")
        size = num_kv_heads * c.num_tokens * head_dim * dtype.itemsize
        if len(c.keys) != size or len(c.values) != size:
            raise CorruptionError(f"{span}: steady-zone chunk has the wrong size")
        for raw, out in ((c.keys, keys), (c.values, values)):
            t = torch.frombuffer(bytearray(raw), dtype=dtype) if size else torch.empty(
                0, dtype=dtype)
            out.append(t.reshape(num_kv_heads, c.num_tokens, head_dim))
    if not keys:
        empty = torch.empty(num_kv_heads, 0, head_dim, dtype=dtype)
        return empty, empty
    return torch.cat(keys, dim=1), torch.cat(values, dim=1)
