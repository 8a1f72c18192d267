"""Bounded slices of query tokens, so a multi-token query never holds a full score matrix.

A prefill chunk of ``L`` tokens queried against ``C`` units (or rows) would otherwise
materialise ``[B, Hkv, G, L, C]`` float32 logits at once: at ``B * L = 16384`` query
tokens, 32 query heads and 8192 clusters (128K context) that is 17 GB per temporary. The
ranking and the reference executor instead walk the ``L`` axis in slices whose logits stay
under :data:`SCORE_BUDGET` elements; the ranking sums (or maxes) over ``L`` anyway and the
attention is independent per query token, so the results are the same.
"""

from __future__ import annotations

__all__ = ["SCORE_BUDGET", "query_slices"]

SCORE_BUDGET = 1 << 26  # float32 score elements held at once per temporary (256 MiB)


def query_slices(num_queries: int, columns: int, *, rows: int = 1) -> list[slice]:
    """Slices of ``range(num_queries)`` whose ``rows x len(slice) x columns`` scores fit
    :data:`SCORE_BUDGET` (at least one query token per slice).

    Parameters
    ----------
    num_queries : int
        ``L``, query tokens.
    columns : int
        Score columns per query token (units, rows or keys attended).
    rows : int
        Score rows per query token (``B * Hq``).

    Examples
    --------
    >>> query_slices(5, 1 << 25, rows=1)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    >>> query_slices(3, 4)
    [slice(0, 3, None)]
    """
    step = max(1, SCORE_BUDGET // max(1, rows * columns))
    return [slice(i, min(i + step, num_queries)) for i in range(0, num_queries, step)]
