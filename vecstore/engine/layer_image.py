"""A layer's indexed segments as placed: rows in the store's tier, metadata on the layer's
device, charged to their budgets, and the index view over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vecstore.index.base import IndexView, Segment
from vecstore.kvstore.base import KVStore, MemoryAccount, StoredRows
from vecstore.kvstore.placement import Placement
from vecstore.kvstore.row_transfer import copy_across, host_writes_together

__all__ = ["LayerImage", "place_segments"]


@dataclass(frozen=True, slots=True)
class LayerImage:
    """A layer's indexed part as placed: rows in the tier, metadata on the layer's device."""

    segments: list[Segment]  # rows and metadata are slices of the tensors below
    rows: StoredRows
    tier: KVStore
    account: MemoryAccount  # charged ``meta_bytes`` for the metadata
    meta_bytes: int
    view: IndexView
    took_old_rows: bool = False  # rows are those of the image it was placed over, or grew them

    def holds(self, segments: list[Segment]) -> bool:
        """Whether ``segments`` are exactly this image's (placed, not replaced since)."""
        return len(self.segments) == len(segments) and self.begins(segments)

    def begins(self, segments: list[Segment]) -> bool:
        """Whether this image's segments are the first of ``segments``."""
        return (len(self.segments) <= len(segments)
                and all(a is b for a, b in zip(self.segments, segments, strict=False)))

    def fits(self, keys: torch.Tensor) -> bool:
        """Whether rows laid out as ``keys`` could replace the image's (:meth:`over_rows`):
        of a tier that shares rows, as many, of the same dtype and device, each head's rows
        contiguous."""
        own = self.rows.keys
        return (type(self.tier).shareable_rows and keys.shape == own.shape
                and keys.dtype == own.dtype and keys.device == own.device
                and keys.stride()[-2:] == (keys.shape[-1], 1))

    def over_rows(self, rows: StoredRows) -> LayerImage:
        """The same image reading its rows from ``rows`` (``[Hkv, N, D]`` holding exactly
        these rows, charged for them): segments and view rebuilt over them with the same
        metadata. The image's own rows are not freed."""
        keys, values = rows.keys, rows.values
        segments, base = [], 0
        for seg in self.segments:
            n = seg.num_tokens
            segments.append(Segment(seg.start, seg.end, keys[:, base:base + n],
                                    values[:, base:base + n], seg.offsets, seg.meta))
            base += n
        old = self.view
        view = IndexView(keys=keys[None], values=values[None], offsets=old.offsets,
                         sizes=old.sizes, meta=old.meta, num_units=old.num_units)
        return LayerImage(segments, rows, self.tier, self.account, self.meta_bytes, view)

    def free(self, *, keep_rows: bool = False) -> None:
        """Return the rows (unless ``keep_rows``) and the metadata to their budgets."""
        if not keep_rows:
            self.tier.free(self.rows)
        self.account.release(self.meta_bytes)


def place_segments(placement: Placement, segments: list[Segment], device: torch.device,
                   dtype: torch.dtype, what: str, old: LayerImage | None,
                   rows: StoredRows | None = None) -> LayerImage:
    """Place ``segments``' rows and metadata for a layer on ``device``; charges the budgets
    (raising :class:`~vecstore.errors.CapacityError`) before allocating. Changes nothing
    else. ``old`` (the layer's current image): rows whose tier does not change are kept, and
    where ``segments`` only add to ``old``'s, the tier grows ``old``'s rows in place if it can
    (:meth:`~vecstore.kvstore.base.KVStore.extend`: only the new rows are copied); the
    image returned then took ``old``'s rows (``took_old_rows``). ``rows``: uninitialised
    ``[Hkv, N, D]`` rows of the tier, charged, which all of ``segments`` are copied into
    instead (a layer's batch row of a stack,
    :func:`~vecstore.engine.batch_build.commit_together`); not freed if this raises.
    ``what`` names the layer in budget errors."""
    H, D = segments[0].keys.shape[0], segments[0].keys.shape[2]
    N = sum(s.num_tokens for s in segments)
    tier = placement.tier(device)
    what = f"{what} ({len(segments)} segments, {N} tokens)"
    account = placement.device_account(device)
    units = sum(s.num_units for s in segments)
    meta_bytes = (sum(_nbytes(v) for s in segments for v in s.meta.values())
                  + sum(_nbytes(s.offsets) for s in segments) + 8 * H * (2 * units + 1))
    account.charge(meta_bytes, f"the index metadata of {what}")
    try:
        # moving a placed layer between devices keeps rows whose tier does not change
        kept = 0
        if rows is not None:
            assert tuple(rows.keys.shape) == (H, N, D), "rows given for other segments"
        elif old is not None and old.tier is tier and old.begins(segments):
            kept = len(old.segments)
            rows = old.rows if kept == len(segments) else tier.extend(
                old.rows, N, f"the rows of {what}")
        if rows is None:
            rows, kept = tier.allocate((H, N, D), dtype, f"the rows of {what}"), 0
    except BaseException:
        account.release(meta_bytes)
        raise
    # copy: nothing below fails for lack of budget
    meta = {k: torch.cat([s.meta[k].to(device) for s in segments], dim=1)
            for k in segments[0].meta}
    placed, parts, base, ubase = [], [segments[0].offsets[:, :1].to(device)], 0, 0
    with host_writes_together():  # the rows in host memory are waited for once
        for i, s in enumerate(segments):
            n, u = s.num_tokens, s.num_units
            k, v = rows.keys[:, base:base + n], rows.values[:, base:base + n]
            if i >= kept:
                copy_across(s.keys, k)
                copy_across(s.values, v)
            offsets = s.offsets.to(device)
            parts.append(offsets[:, 1:] + base)
            placed.append(Segment(s.start, s.end, k, v, offsets,
                                  {key: t[:, ubase:ubase + u] for key, t in meta.items()}))
            base += n
            ubase += u
    view_offsets = torch.cat(parts, dim=1)
    view = IndexView(keys=rows.keys[None], values=rows.values[None],
                     offsets=view_offsets[None], sizes=view_offsets.diff(dim=-1)[None],
                     meta={key: t[None] for key, t in meta.items()},
                     num_units=torch.tensor([units]))
    return LayerImage(placed, rows, tier, account, meta_bytes, view, took_old_rows=kept > 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
