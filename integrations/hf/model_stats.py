"""What a :class:`~integrations.hf.cache.WaveCache`'s decode steps read, layer kind by kind."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from attention import DecodeStats
from integrations.hf.window_cache import WindowLayer
from vecstore.types import QueryStats

if TYPE_CHECKING:
    from integrations.hf.beams import Branches
    from integrations.hf.capabilities import ModelShape

__all__ = ["ModelDecodeStats", "model_decode_stats"]


@dataclass(frozen=True, slots=True)
class ModelDecodeStats(DecodeStats):
    """:class:`attention.DecodeStats` of the store layers, and the sliding-window layers
    apart.

    The inherited fields (``queries``, ``tokens_total``, ``tokens_exact``,
    ``estimated_mass``, ``exact_fraction``) cover the full-attention layers, which go
    through the store. The sliding-window layers attend exactly to their window, outside
    the store.

    Attributes
    ----------
    windowed_layers : tuple[int, ...]
        The model's sliding-window layers.
    window_queries : int
        Decode steps x sliding-window layers.
    window_tokens : int
        Keys those steps attended to (each at most its window), summed.
    """

    windowed_layers: tuple[int, ...] = ()
    window_queries: int = 0
    window_tokens: int = 0


def _weighted(a: DecodeStats, b: DecodeStats) -> DecodeStats:
    n = a.queries + b.queries
    mass = (a.estimated_mass * a.queries + b.estimated_mass * b.queries) / n if n else 0.0
    return DecodeStats(queries=n, tokens_total=a.tokens_total + b.tokens_total,
                       tokens_exact=a.tokens_exact + b.tokens_exact, estimated_mass=mass)


def model_decode_stats(base: DecodeStats, branches: Branches | None, shape: ModelShape,
                       layers: Sequence[Any]) -> ModelDecodeStats:
    """``base`` (the store's decode queries), plus those of beams' branches (folded
    here: one host sync when the device holds any), plus the window layers' counts."""
    if branches is not None and branches.stats:
        pending: list[QueryStats] = branches.stats
        QueryStats.materialize(pending)
        extra = DecodeStats()
        for s in pending:
            extra = extra.add(s)
        pending.clear()
        branches.folded = _weighted(branches.folded, extra)
    if branches is not None:
        base = _weighted(base, branches.folded)
    windows = [layer for layer in layers if isinstance(layer, WindowLayer)]
    return ModelDecodeStats(
        **{f.name: getattr(base, f.name) for f in fields(DecodeStats)},
        windowed_layers=shape.windowed_layers,
        window_queries=sum(w.decode_queries for w in windows),
        window_tokens=sum(w.decode_tokens for w in windows))
