"""Name → implementation registries, one per pluggable interface."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

from vecstore.errors import ConfigError

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """A registry of factories for one interface, looked up by exact lowercase name.

    Examples
    --------
    >>> r: Registry[type] = Registry("thing")
    >>> @r.register("plain")
    ... class Plain: ...
    >>> r.get("plain") is Plain
    True
    >>> r.names()
    ['plain']
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``.

        A name already taken by a different object raises; re-registering the same
        definition (a module imported again, e.g. by ``importlib.reload``) replaces it.
        """

        def deco(obj: T) -> T:
            if name in self._items and _qualname(self._items[name]) != _qualname(obj):
                raise ConfigError(f"{self.what} {name!r} is already registered")
            if name != name.lower() or not name.replace("_", "").isalnum():
                raise ConfigError(f"{self.what} name {name!r} must be lowercase snake_case")
            self._items[name] = obj
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plug-in registered for a while, e.g. by a test).

        Raises
        ------
        ConfigError
            If no such name is registered.

        Examples
        --------
        >>> r: Registry[type] = Registry("thing")
        >>> _ = r.register("temp")(int)
        >>> r.unregister("temp")
        >>> "temp" in r
        False
        """
        self.get(name)
        del self._items[name]

    def get(self, name: str) -> T:
        """Return the implementation registered as ``name``.

        Raises
        ------
        ConfigError
            If no such name is registered; the message lists the known names and the
            closest match.
        """
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self._items, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown {self.what} {name!r}: available {sorted(self._items)}{hint}"
            ) from None

    def names(self) -> list[str]:
        """Sorted list of registered names."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"
