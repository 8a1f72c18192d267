"""The GPU account a wave buffer charges when its builder passes none.

The store runs each query inside :func:`charging`, so a :class:`~vecstore.buffer.WaveBuffer`
that an executor builds for it charges its block cache and execution buffer to the store's
``kvstore.gpu_budget_gb`` account of the buffer's device, before allocating anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from vecstore.kvstore.base import MemoryAccount

__all__ = ["charging", "account_for"]

_ACCOUNTS: ContextVar[Callable[[torch.device], MemoryAccount] | None] = ContextVar(
    "vecstore_buffer_accounts", default=None)


@contextmanager
def charging(accounts: Callable[[torch.device], MemoryAccount] | None) -> Iterator[None]:
    """Within the block, buffers built without an account charge ``accounts(device)``.

    Examples
    --------
    >>> acct = MemoryAccount(0, "gpu")
    >>> with charging(lambda dev: acct):
    ...     account_for(torch.device("cpu")) is acct
    True
    >>> account_for(torch.device("cpu")) is None
    True
    """
    token = _ACCOUNTS.set(accounts)
    try:
        yield
    finally:
        _ACCOUNTS.reset(token)


def account_for(device: torch.device) -> MemoryAccount | None:
    """The account a buffer on ``device`` charges here, if any."""
    accounts = _ACCOUNTS.get()
    return None if accounts is None else accounts(device)
