"""How the wave executor spreads a decode step over CUDA streams: row groups and stream roles.

A step's rows may be served in groups (:func:`pipeline_groups`): the current stream computes
every group's centroid logits one after the other, and each group's selection and attention
run on a stream of their own. Streams are kept per device, role and group
(:class:`StreamPool`); off CUDA there are none and the work runs in order.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["pipeline_groups", "StreamPool", "on"]

# row groups of a step: each group's selection (latency-bound) and attention run on a stream of
# their own while the next group's logits (bandwidth-bound) stream the centroids. H200, whole
# steps against one group: 32 x 128K 0.439-0.488 against 0.500 ms in six captures of 4
# groups. At 512K and 1M the groups gained on average nothing and varied from capture to
# capture (8 x 512K 0.413-0.491 against 0.434, 4 x 1M 0.416-0.443 against 0.426, 8 x 1M
# 0.763-0.878 against 0.787-0.791): the selection of one group, starved of SMs by the next
# group's logits and the previous group's attention, ran 2-3x slower. So groups of at least
# 64 rows, and only where the selection is long (rows x clusters >= 2**21). With int8
# centroid codes the logits take ~130 instead of ~160 us at 4 x 1M, and two groups of at
# least 16 rows pay: 0.382 / 0.371 / 0.695 ms at 8 x 512K / 4 x 1M / 8 x 1M against 0.393 /
# 0.387 / 0.700 in one group (three or four groups: 0.381-0.392 / 0.371 / 0.696-0.750)
_PIPELINE_GROUPS = 2
_PIPELINE_MIN_ROWS = 16
_PIPELINE_MIN_SCORES = 1 << 21
# priority of the selection streams: -1 (high) measured 0.152 against 0.164 ms at 1 x 1M but
# 0.425-0.431 against 0.417 at 4 x 1M (2 groups) and 0.459-0.467 against 0.439 at 32 x 128K; the
# offloaded step at 1 x 1M 0.412 against 0.404
_SELECT_PRIORITY = 0
# priority of the selection stream of a resident step served in one group: -1 measured 0.101
# against 0.104 ms at 4 x 128K, 0.347 against 0.353 at 24 x 128K, the same at 1 x 128K,
# 8 x 128K and 4 x 512K
_SOLE_PRIORITY = -1


def pipeline_groups(rows: int, clusters: int) -> int:
    """Row groups a step over ``rows`` (sequence, KV head) rows of ``clusters`` clusters is
    pipelined in."""
    if rows * clusters < _PIPELINE_MIN_SCORES:
        return 1
    return max(1, min(_PIPELINE_GROUPS, rows // _PIPELINE_MIN_ROWS))


class StreamPool:
    """The streams of a step by role and row group, created once per device.

    Roles: ``select`` (a group's selection and retrieved attention, at
    ``_SELECT_PRIORITY``), ``sole`` (the same for a resident step's only group, at
    ``_SOLE_PRIORITY``), ``side`` (its steady and estimated zones), ``admit`` (an offloaded
    view's admission).

    Examples
    --------
    >>> StreamPool().get(torch.device("cpu"), "select") is None  # no streams off CUDA
    True
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, str, int], torch.cuda.Stream] = {}

    def get(self, dev: torch.device, role: str, group: int = 0) -> torch.cuda.Stream | None:
        """Row group ``group``'s stream for ``role`` on ``dev``, ``None`` off CUDA."""
        if dev.type != "cuda":
            return None
        key = (dev, role, group)
        stream = self._streams.get(key)
        if stream is None:
            priority = {"select": _SELECT_PRIORITY, "sole": _SOLE_PRIORITY}.get(role, 0)
            stream = self._streams[key] = torch.cuda.Stream(dev, priority=priority)
        return stream


def on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Run the block on ``stream``, or on the current stream when it is ``None`` (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
