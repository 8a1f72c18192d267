"""The :class:`CachePolicy` protocol, the policy registry and helpers shared by policies.

A policy decides which keys of a fixed-capacity cache stay resident. It only keeps
bookkeeping: where the cached data lives (slots, tensors) is the caller's business, see
:class:`vecstore.buffer.WaveBuffer` and its
:class:`~vecstore.buffer.bookkeeping.PolicyBookkeeper`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable
from typing import Protocol, TypeVar, runtime_checkable

from vecstore.errors import CapacityError, InvalidValueError, NotFoundError
from vecstore.registry import Registry

__all__ = ["CachePolicy", "POLICIES", "QueuePolicy", "make_policy", "check_capacity",
           "check_absent", "first_unprotected", "not_resident"]

K = TypeVar("K", bound=Hashable)


@runtime_checkable
class CachePolicy(Protocol):
    """Admission and eviction for a cache holding at most ``capacity`` keys.

    Keys are hashable (ints or tuples such as ``(sequence, kv_head, cluster)``). The
    caller reports every hit with :meth:`touch` and every miss it wants cached with
    :meth:`admit`; the policy answers which resident keys to evict.
    """

    @property
    def capacity(self) -> int:
        """Most keys resident at once (>= 1)."""
        ...

    def __len__(self) -> int:
        """Number of resident keys."""
        ...

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident."""
        ...

    def touch(self, key: Hashable) -> None:
        """Record a hit on the resident ``key``; raise :class:`NotFoundError` otherwise."""
        ...

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Make the non-resident ``key`` resident and return the keys evicted for it.

        Parameters
        ----------
        key : Hashable
            A key that is not resident (:class:`InvalidValueError` otherwise).
        protected : Container[Hashable]
            Keys that must not be evicted (those used by the current step).

        Returns
        -------
        list[Hashable]
            The resident key evicted to make room (one when the cache was full, none
            otherwise), never one in ``protected``; so ``len(self) <= capacity``.

        Raises
        ------
        CapacityError
            The cache is full and every resident key is protected; nothing changes.
        """
        ...

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` (resident or remembered in a history); no-op if unknown."""
        ...

    def keys(self) -> list[Hashable]:
        """The resident keys, in the order the policy considers them for eviction.

        Exactly the eviction order for ``lru``, ``fifo`` and ``lfu``; for ``clock``,
        ``arc`` and ``s3fifo`` the order their sweeps visit keys (reference bits,
        adaptive targets and counts can still spare a key that comes early).
        """
        ...


POLICIES: Registry[Callable[[int], CachePolicy]] = Registry("cache policy")
"""Replacement policies by name: ``lru``, ``fifo``, ``lfu``, ``clock``, ``arc``, ``s3fifo``."""


def make_policy(name: str, capacity: int) -> CachePolicy:
    """Build the policy registered as ``name`` for ``capacity`` keys.

    Parameters
    ----------
    name : str
        A name from ``POLICIES.names()``, as given in the config key ``cache.policy``.
    capacity : int
        Most keys resident at once, >= 1.

    Raises
    ------
    ConfigError
        ``name`` is not registered; the message lists the known names.
    InvalidValueError
        ``capacity`` is not an integer >= 1.

    Examples
    --------
    >>> lru = make_policy("lru", 2)
    >>> lru.admit("a"), lru.admit("b")
    ([], [])
    >>> lru.touch("a")
    >>> lru.admit("c")
    ['b']
    >>> lru.keys()
    ['a', 'c']
    """
    return POLICIES.get(name)(capacity)


def check_capacity(capacity: object) -> int:
    """Return ``capacity`` if it is an integer >= 1, else raise :class:`InvalidValueError`."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise InvalidValueError(f"capacity: expected an integer >= 1, got {capacity!r}")
    if capacity < 1:
        raise InvalidValueError(f"capacity: expected an integer >= 1, got {capacity}")
    return capacity


def check_absent(policy: CachePolicy, key: Hashable) -> None:
    """Raise :class:`InvalidValueError` if ``key`` is already resident in ``policy``."""
    if key in policy:
        raise InvalidValueError(f"admit: key {key!r} is already resident; call touch() for a hit")


def first_unprotected(order: Iterable[K], protected: Container[Hashable], key: Hashable) -> K:
    """The first key of ``order`` not in ``protected``: the victim that makes room for ``key``.

    Raises
    ------
    CapacityError
        Every key of ``order`` is protected.
    """
    for k in order:
        if k not in protected:
            return k
    raise CapacityError(f"admit: every resident key is protected; no room for {key!r}")


def not_resident(key: Hashable) -> NotFoundError:
    """The error :meth:`CachePolicy.touch` raises for a key that is not resident."""
    return NotFoundError(f"touch: key {key!r} is not resident; call admit() for a miss")


class QueuePolicy(ABC):
    """A policy whose resident keys form one queue, evicted from its front (the first
    unprotected key) and admitted at its back; subclasses say what a hit does
    (:meth:`_hit`).

    Parameters
    ----------
    capacity : int
        Most keys resident at once, >= 1.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_capacity(capacity)
        self._queue: OrderedDict[Hashable, None] = OrderedDict()  # next victim first

    @property
    def capacity(self) -> int:
        """Most keys resident at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, key: object) -> bool:
        return key in self._queue

    def touch(self, key: Hashable) -> None:
        """Record a hit on the resident ``key``."""
        if key not in self._queue:
            raise not_resident(key)
        self._hit(key)

    def admit(
        self, key: Hashable, *, protected: Container[Hashable] = frozenset()
    ) -> list[Hashable]:
        """Append ``key``, evicting the first unprotected key of the queue if full."""
        check_absent(self, key)
        evicted = []
        if len(self._queue) >= self._capacity:
            victim = first_unprotected(self._queue, protected, key)
            del self._queue[victim]
            evicted.append(victim)
        self._queue[key] = None
        return evicted

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if resident."""
        self._queue.pop(key, None)

    def keys(self) -> list[Hashable]:
        """Resident keys in eviction order."""
        return list(self._queue)

    @abstractmethod
    def _hit(self, key: Hashable) -> None:
        """What a hit on the resident ``key`` does to the queue."""
