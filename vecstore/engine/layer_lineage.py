"""Lineages of layers' indexed segments: an id a layer renews whenever its segments are
removed or replaced other than by appending, never the same in two layers of a process. A
copy of a layer's first ``k`` segments (a batch's stacked view of its rows,
:class:`vecstore.engine.batch.BatchViews`) holds what they hold while the id stays."""

from __future__ import annotations

import itertools

__all__ = ["new_lineage"]

_LINEAGES = itertools.count()


def new_lineage() -> int:
    """A lineage that no layer of this process held before."""
    return next(_LINEAGES)
