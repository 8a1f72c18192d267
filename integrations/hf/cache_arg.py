"""The name of the cache argument of a model's ``forward`` and ``generate``.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works
there, with a ``FutureWarning``, until 5.40); earlier 5.x releases only know
``past_key_values``. Code that runs on both passes the cache through these helpers.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_kwarg", "cache_arg"]


def cache_kwarg(model: Any) -> str:
    """``"cache"`` if ``model``'s forward takes a ``cache`` argument, else
    ``"past_key_values"``.

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=1, num_attention_heads=4)
    >>> cache_kwarg(LlamaForCausalLM(cfg)) in ("cache", "past_key_values")
    True
    """
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the name ``model`` takes, for ``model(**...)`` and
    ``model.generate(**...)``.

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=1, num_attention_heads=4)
    >>> list(cache_arg(LlamaForCausalLM(cfg), None)) == [cache_kwarg(LlamaForCausalLM(cfg))]
    True
    """
    return {cache_kwarg(model): cache}
