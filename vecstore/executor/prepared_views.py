"""What an executor prepared per index view and budget, built once and kept for the most
recently used views."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from vecstore.config import LayerConfig
from vecstore.index.base import IndexView

__all__ = ["PreparedViews"]


class _Prepared(Protocol):
    @property
    def view(self) -> IndexView: ...


P = TypeVar("P", bound=_Prepared)


class PreparedViews(Generic[P]):
    """An executor's prepared forms of views, keyed by the view's identity and the layer's
    budgets; the least recently used beyond ``limit`` are dropped, and a view the store
    replaces or drops is forgotten (:meth:`release`). Each dropped form is passed to
    ``on_drop`` (to free what it holds, e.g. a wave buffer).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from vecstore.config import StoreConfig
    >>> views = PreparedViews(limit=1)
    >>> layer, a, b = StoreConfig().for_layer(0), object(), object()
    >>> views.get(a, layer, lambda: SimpleNamespace(view=a)).view is a
    True
    >>> _ = views.get(b, layer, lambda: SimpleNamespace(view=b))  # drops a's
    >>> len(views), [p.view is b for p in views.values()]
    (1, [True])
    """

    def __init__(self, limit: int = 512, on_drop: Callable[[P], None] | None = None) -> None:
        self._limit = limit
        self._on_drop = on_drop
        self._items: OrderedDict[tuple[int, float, float], P] = OrderedDict()

    def get(self, view: IndexView, layer: LayerConfig, build: Callable[[], P]) -> P:
        """The form prepared for ``view`` and ``layer``'s budgets, built by ``build`` the
        first time."""
        key = (id(view), layer.retrieval_budget, layer.estimation_budget)
        prep = self._items.get(key)
        if prep is not None and prep.view is view:
            self._items.move_to_end(key)
            return prep
        prep = self._items[key] = build()
        while len(self._items) > self._limit:
            self._drop(self._items.popitem(last=False)[1])
        return prep

    def release(self, view: IndexView) -> None:
        """Forget every form prepared for ``view``."""
        for key in [k for k, p in self._items.items() if p.view is view]:
            self._drop(self._items.pop(key))

    def values(self) -> Iterator[P]:
        """The prepared forms, least recently used first."""
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, prep: P) -> None:
        if self._on_drop is not None:
            self._on_drop(prep)
