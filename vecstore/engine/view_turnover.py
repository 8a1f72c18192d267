"""The index views a holder (a layer, a batch's stacks) replaced since the engine last asked,
and which of them were replaced by growing: what an executor prepared for a grown view's
predecessor can serve the grown view."""

from __future__ import annotations

from vecstore.index.base import IndexView

__all__ = ["ViewTurnover"]


class ViewTurnover:
    """Views no query will use again, and ``(old, new)`` successions where ``new`` replaced
    ``old`` by appending segments over the same rows (``old``'s units are ``new``'s first).

    Examples
    --------
    >>> turnover, a, b = ViewTurnover(), object(), object()
    >>> turnover.retire(a, successor=b)
    >>> turnover.take() == ([a], [(a, b)]), turnover.take()
    (True, ([], []))
    """

    def __init__(self) -> None:
        self._retired: list[IndexView] = []
        self._successions: list[tuple[IndexView, IndexView]] = []

    def retire(self, old: IndexView, successor: IndexView | None = None) -> None:
        """``old`` is replaced (by ``successor`` grown from it, if given)."""
        self._retired.append(old)
        if successor is not None:
            self._successions.append((old, successor))

    def take(self) -> tuple[list[IndexView], list[tuple[IndexView, IndexView]]]:
        """The views retired and the successions since the last call, forgotten here."""
        taken = self._retired, self._successions
        self._retired, self._successions = [], []
        return taken
