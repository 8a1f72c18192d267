"""One layer of one sequence: the steady zone, the indexed segments, and their growth."""

from __future__ import annotations

import torch

from vecstore.config import StoreConfig
from vecstore.engine.layer_image import LayerImage, place_segments
from vecstore.engine.layer_lineage import new_lineage
from vecstore.engine.layer_mark import LayerMark
from vecstore.engine.layer_staging import StagedAppend
from vecstore.engine.tail import PendingTail, TailBuffer, TailHolder
from vecstore.engine.view_turnover import ViewTurnover
from vecstore.index.base import Index, IndexView, Segment
from vecstore.kvstore.base import StoredRows
from vecstore.kvstore.placement import Placement

__all__ = ["LayerState"]


class LayerState(TailHolder):
    """Tokens of one layer: sinks, indexed segments, and a pending tail.

    Tokens ``[0, sink)`` stay in ``sink_keys``; later tokens enter the pending tail,
    and whenever the tail exceeds ``window_tokens + update_tokens`` all but its last
    ``window_tokens`` are indexed into new segments. Sinks and the tail form the exact
    steady zone.

    With a ``placement`` (what a store gives), the indexed rows of all segments are one
    cluster-contiguous ``[Hkv, N, D]`` allocation in the store's tier (the layer's device
    for ``kvstore.kind = "memory"``, host memory for ``"pinned"``), and their metadata one
    allocation per tensor on the layer's device; each segment holds slices of them and the
    layer's index view is them, without a copy. Both are charged to their budgets before
    anything changes, so a budget too small raises
    :class:`~vecstore.errors.CapacityError` and leaves the layer as it was.

    Index views the layer replaces (it grew, rolled back, moved, shared its rows or was
    released) are no longer queried: ``turnover`` (:class:`ViewTurnover`) hands them to the
    engine, which lets the executor free what it prepared for them, or hand it to the view
    that grew from one.

    ``version`` changes whenever the segments do; ``lineage``
    (:mod:`~vecstore.engine.layer_lineage`) only when segments are removed or replaced other
    than by appending (a rollback to fewer, :meth:`release`, a lazy layer's load).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, index: Index, config: StoreConfig, *,
                 placement: Placement | None = None, label: str = "") -> None:
        empty = torch.empty(num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.sink_keys, self.sink_values = empty, empty
        self._tail = PendingTail(empty, empty)
        self.segments: list[Segment] = []
        self.device = torch.device(device)
        self.index = index
        self.config = config
        self.placement = placement
        self.label = label or "a layer"
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.version = 0
        self.lineage = new_lineage()
        self._indexed = (0, 0)  # (version, tokens in segments) of the last count
        self.tail_buffer: TailBuffer | None = None  # a batch's (vecstore.engine.shared_tail)
        self._view: IndexView | None = None
        self._image: LayerImage | None = None
        self.turnover = ViewTurnover()

    @property
    def num_tokens(self) -> int:
        return self.sink_keys.shape[1] + self._pending().length + self.num_indexed

    @property
    def num_indexed(self) -> int:
        """Tokens in the segments, counted again only after they change (``version``):
        decode asks for it several times per step and layer."""
        version, count = self._indexed
        if version != self.version:
            count = sum(s.num_tokens for s in self.segments)
            self._indexed = (self.version, count)
        return count

    @property
    def rows(self) -> StoredRows | None:
        """The placed rows of every segment (``None`` before the first, or unplaced)."""
        return None if self._image is None else self._image.rows

    def mark(self) -> LayerMark:
        """The layer as it is now, for :meth:`restore`."""
        return LayerMark(self.sink_keys, self.sink_values, self.pending_keys,
                         self.pending_values, len(self.segments))

    def restore(self, mark: LayerMark) -> None:
        """Put the layer back as it was at ``mark`` (and drop its cached view)."""
        self.sink_keys, self.sink_values = mark.sink_keys, mark.sink_values
        self._tail.set(mark.pending_keys, mark.pending_values)
        if mark.num_segments < len(self.segments):
            self.lineage = new_lineage()
        self.segments = self.segments[:mark.num_segments]
        self.add_segments([])  # bumps the version and drops the cached view

    def append(self, keys: torch.Tensor, values: torch.Tensor, *,
               whole_segments: bool = False) -> list[Segment]:
        """Add ``[Hkv, T, D]`` tokens; returns the segments this append created.

        ``whole_segments`` (a prefill chunk): index only whole ``index.segment_tokens``
        segments, so a prompt is segmented as configured whatever its chunks; the rest
        waits in the tail for a later append (the first decode step's at the latest).
        """
        staged = self.stage(keys, values, whole_segments=whole_segments)
        return self.commit(staged, self.build(staged))

    def stage(self, keys: torch.Tensor, values: torch.Tensor, *,
              whole_segments: bool = False) -> StagedAppend:
        """What :meth:`append` would do, worked out without changing the layer: its
        steady zone after the append and the tail tokens it indexes (``ready``)."""
        return StagedAppend.appending(
            self.config, (self.sink_keys, self.sink_values),
            (self.pending_keys, self.pending_values), self.num_indexed, keys, values,
            whole_segments=whole_segments)

    def build(self, staged: StagedAppend) -> list[Segment]:
        """The segments indexing ``staged``'s ready tokens (none if there are none)."""
        if not staged.ready:
            return []
        keys, values = staged.ready_tokens()
        return self.index.build(keys, values, staged.start)

    def commit(self, staged: StagedAppend, built: list[Segment],
               rows: StoredRows | None = None) -> list[Segment]:
        """Make ``staged`` the layer's, ``built`` (:meth:`build`'s segments of it) indexed
        and placed; returns them as the layer holds them. ``rows``: charged rows of the
        tier to place every segment in (:func:`place_segments`; the caller frees them if
        this raises). A placement that does not fit raises
        :class:`~vecstore.errors.CapacityError` and changes nothing."""
        pending_keys, pending_values = staged.pending_keys, staged.pending_values
        image = None
        if built:
            pending_keys = pending_keys[:, staged.ready:].contiguous()
            pending_values = pending_values[:, staged.ready:].contiguous()
            # may raise: nothing changed yet
            image = self._place(self.segments + built, rows=rows)
        self.sink_keys, self.sink_values = staged.sink_keys, staged.sink_values
        self._tail.set(pending_keys, pending_values)
        if built:
            self.tail_buffer = None  # the tail is a tensor of its own now
            self._install(self.segments + built, image, appended=True)
            built = self.segments[-len(built):]
        return built

    def seal(self) -> list[Segment]:
        """Index every tail token but the last ``window_tokens`` now, however few (at the
        end of a prefill, so the rows of a batch keep equally long tails); returns the
        segments created."""
        staged = self.stage_seal()
        return self.commit(staged, self.build(staged))

    def stage_seal(self) -> StagedAppend:
        """What :meth:`seal` would do, worked out without changing the layer."""
        return StagedAppend.sealing(self.config, (self.sink_keys, self.sink_values),
                                    (self.pending_keys, self.pending_values),
                                    self.num_indexed)

    def add_segments(self, segments: list[Segment]) -> None:
        """Attach already-built segments (appends and reopened stores); with a placement
        their rows are copied into the tier (:class:`CapacityError` changes nothing).

        ``add_segments([])`` after ``segments`` was cut back (a rollback) only drops the
        cached view; the layer is placed again when next viewed.
        """
        if not segments:
            self._install(self.segments, None, keep=True)
            return
        everything = self.segments + list(segments)
        self._install(everything, self._place(everything), appended=True)

    def to(self, device: torch.device) -> None:
        """Move every tensor of the layer to ``device`` (loading it first if lazy).

        Placed rows follow the tier: they move with the layer for ``memory`` and stay in
        host memory for ``pinned``.
        """
        device = torch.device(device)
        if device == self.device:
            return
        segments = self.segments
        image = None
        if self.placement is not None and segments:
            image = self._place(segments, device)  # may raise: nothing changed yet
        else:
            segments = [
                Segment(s.start, s.end, s.keys.to(device), s.values.to(device),
                        s.offsets.to(device), {k: v.to(device) for k, v in s.meta.items()})
                for s in segments
            ]
        self.sink_keys, self.sink_values = self.sink_keys.to(device), self.sink_values.to(device)
        self._tail.set(self.pending_keys.to(device), self.pending_values.to(device))
        self.tail_buffer = None  # the tail no longer lives in it
        self.device = device
        self._install(segments, image)

    def steady(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[Hkv, S, D]`` keys and values of the steady zone (sinks, then the tail)."""
        return (torch.cat([self.sink_keys, self.pending_keys], dim=1),
                torch.cat([self.sink_values, self.pending_values], dim=1))

    def view(self) -> IndexView | None:
        """The indexed segments as a ``B = 1`` view, cached until they change."""
        segments = self.segments
        if (self.placement is not None and (segments or self._image is not None)
                and not self._is_placed(segments)):
            # loaded lazily or rolled back: place (or re-place) what the layer holds now
            if self._image is not None:
                # return the old allocation first, so a smaller one always fits; the
                # segments keep its tensors readable until the new one is installed
                self._image.free()
                self._image = None
            self._install(segments, self._place(segments))
        if not segments:
            return None
        if self._view is None:
            self._view = IndexView.from_segments(segments)
        return self._view

    def can_share(self, keys: torch.Tensor) -> bool:
        """Whether :meth:`share_rows` may give the layer rows laid out as ``keys``."""
        image = self._image
        return image is not None and image.holds(self.segments) and image.fits(keys)

    def share_rows(self, rows: StoredRows) -> None:
        """Read the placed rows from ``rows`` from now on and free the layer's own
        (:meth:`can_share` said it may).

        ``rows`` hold exactly the layer's rows, charged for them (a batch row of a stacked
        view split by the tier, :class:`vecstore.engine.batch.BatchViews`), so a batch
        decodes from one copy of its KV instead of two. The segments and the view are
        rebuilt over them with the same metadata, and ``version`` and ``lineage`` stay (the
        contents did not change); where the tier grows rows in place, the layer then grows
        its batch row of the stack.
        """
        image = self._image
        assert image is not None
        self._image = image.over_rows(rows)
        self.segments, self._view = self._image.segments, self._image.view
        self.turnover.retire(image.view)
        image.tier.free(image.rows)

    def release(self, *, forget: bool = True) -> None:
        """Return the placed rows and metadata to their budgets (the sequence was dropped,
        or the store closed); never loads a lazy layer.

        With ``forget`` the layer also lets go of its segments, so their memory is freed;
        without, the tensors stay readable (unaccounted, and no longer pinned).
        """
        image = self._image
        if image is not None:
            self._image = None
            image.free()
            if self._view is not None:
                self.turnover.retire(self._view)
            if forget:
                self.segments = []
                self._view = None
                self.version += 1
                self.lineage = new_lineage()

    # -- placement -----------------------------------------------------------------------
    def _is_placed(self, segments: list[Segment]) -> bool:
        return self._image is not None and self._image.holds(segments)

    def _place(self, segments: list[Segment], device: torch.device | None = None, *,
               rows: StoredRows | None = None) -> LayerImage | None:
        """Place ``segments`` for the layer on ``device`` (:func:`place_segments`, in
        ``rows`` if given), or ``None`` without a placement or segments. Changes nothing."""
        if self.placement is None or not segments:
            assert rows is None, "rows given for a layer that places none"
            return None
        dev = self.device if device is None else torch.device(device)
        return place_segments(self.placement, segments, dev, self.dtype, self.label,
                              self._image, rows)

    def _install(self, segments: list[Segment], image: LayerImage | None, *,
                 keep: bool = False, appended: bool = False) -> None:
        """Make ``segments`` (or ``image``, their placed form) the layer's and free the old
        image, unless ``keep`` (it stays charged until the layer is placed again).
        ``appended``: ``segments`` are the layer's with more appended, so the new view
        succeeds the old one (``turnover``)."""
        old, old_view = self._image, self._view
        if image is not None:
            self.segments, self._view = image.segments, image.view
        else:
            self.segments, self._view = segments, None
        if not keep:
            self._image = image
            if old is not None:
                old.free(keep_rows=image is not None and image.took_old_rows)
        if old_view is not None and old_view is not self._view and self.placement is not None:
            self.turnover.retire(old_view, successor=self._view if appended else None)
        self.version += 1
