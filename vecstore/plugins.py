"""The pluggable parts a configuration names, checked against their registries before
anything is built or written."""

from __future__ import annotations

from vecstore.cluster import CLUSTERERS
from vecstore.config import StoreConfig
from vecstore.executor import EXECUTORS
from vecstore.executor.base import resolve_kind
from vecstore.index import INDEXES
from vecstore.kvstore import KVSTORES
from vecstore.policies import POLICIES

__all__ = ["check_plugins"]


def check_plugins(config: StoreConfig) -> None:
    """Raise :class:`~vecstore.errors.ConfigError` (naming the known names and the
    closest) if ``config`` names an index, clusterer, executor, kvstore tier or cache
    policy that is not registered.

    Examples
    --------
    >>> from vecstore.errors import ConfigError
    >>> check_plugins(StoreConfig())
    >>> try:
    ...     check_plugins(StoreConfig.from_dict({"cache": {"policy": "lur"}}))
    ... except ConfigError as exc:
    ...     print(str(exc).split(": available")[0])
    unknown cache policy 'lur'
    """
    INDEXES.get(config.index.kind)
    CLUSTERERS.get(config.cluster.kind)
    EXECUTORS.get(resolve_kind(config.executor.kind, config.executor.device))
    KVSTORES.get(config.kvstore.kind)
    POLICIES.get(config.cache.policy)
