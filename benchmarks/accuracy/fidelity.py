"""Attention-output fidelity on the real model's KV, per layer and method.

A prompt is prefilled exactly; the queries of its last ``n`` tokens (the question and
answer prefix: what decoding asks) are captured at every layer, and the KV of the tokens
before them is the context. For each method, the context goes into a store of that
method's configuration and each query is answered by ``store.query`` as a decode step
(one query token per batch row). Compared with exact float64 attention over the same
context:

- relative L2 error of the layer's output, ``|out - ref| / |ref|`` over heads and queries;
- captured softmax mass, the mean of ``exp(lse - lse_ref)``: the share of the exact
  softmax denominator the method accounts for (for ``wave`` it includes the estimated
  clusters, a lower bound of their mass by Jensen; ``wave_noest`` gives the exact part).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from benchmarks.accuracy.harness import method_config
from integrations.hf.cache import cache_kwarg
from integrations.hf.install import model_shape
from integrations.tasks import Sample
from vecstore import Store

__all__ = ["Captured", "LayerFidelity", "capture", "layer_fidelity", "run_fidelity"]


@dataclass(frozen=True, slots=True)
class Captured:
    """Per-layer decode queries and context KV of one prompt.

    Attributes
    ----------
    queries : list[torch.Tensor]
        ``[Hq, n, D]`` post-RoPE queries of the last ``n`` prompt tokens.
    keys, values : list[torch.Tensor]
        ``[Hkv, C, D]`` KV of the ``C`` tokens before them.
    """

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass(frozen=True, slots=True)
class LayerFidelity:
    """One method's fidelity at one layer of one prompt.

    Attributes
    ----------
    task, method, layer
        What was measured (``full`` is the store's exact ``flat`` index).
    rel_error : float
        ``|out - ref| / |ref|`` over heads and queries.
    captured_mass : float
        Mean ``exp(lse - lse_ref)``.
    exact_fraction : float
        Share of the context read exactly per query.
    estimated_mass : float
        Share of the method's softmax mass carried by estimation.
    context_tokens : int
        ``C``.
    """

    task: str
    method: str
    layer: int
    rel_error: float
    captured_mass: float
    exact_fraction: float
    estimated_mass: float
    context_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def _query_hooks(model: PreTrainedModel, store: dict[int, torch.Tensor],
                 last: int) -> Iterator[None]:
    """Record each attention module's post-RoPE queries of the last ``last`` tokens."""
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = kwargs["hidden_states"][:, -last:]
        cos, sin = (t[:, -last:] for t in kwargs["position_embeddings"])
        q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
        rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
        store[module.layer_idx] = rope(q, q, cos, sin)[0][0].detach()

    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and hasattr(m, "q_proj")]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sample: Sample,
            num_queries: int) -> Captured:
    """Prefill ``sample`` exactly, keeping the last ``num_queries`` tokens' queries."""
    device = next(model.parameters()).device
    ids = tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    queries: dict[int, torch.Tensor] = {}
    cache = DynamicCache()
    with _query_hooks(model, queries, num_queries):
        model(ids.to(device), **{cache_kwarg(model): cache}, use_cache=True)
    ctx = ids.shape[1] - num_queries
    return Captured(queries=[queries[i] for i in range(len(cache.layers))],
                    keys=[layer.keys[0, :, :ctx] for layer in cache.layers],
                    values=[layer.values[0, :, :ctx] for layer in cache.layers])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[0] // k.shape[0]
    kd = k.double().repeat_interleave(groups, 0)
    logits = scale * q.double() @ kd.transpose(1, 2)  # [Hq, n, C]
    return torch.softmax(logits, -1) @ v.double().repeat_interleave(groups, 0), \
        torch.logsumexp(logits, -1)


def layer_fidelity(captured: Captured, method: str, budget: float, *, task: str,
                   model: PreTrainedModel,
                   base: Mapping[str, Any] | None = None) -> list[LayerFidelity]:
    """Fidelity of ``method`` (``full`` = exact ``flat`` index) at every layer."""
    shape = model_shape(model)
    config = method_config(method, budget, base) or {"index": {"kind": "flat"}}
    scale = 1.0 / math.sqrt(shape.head_dim)
    out: list[LayerFidelity] = []
    with Store.open(config=config) as store:
        seq = store.create("ctx", num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                           head_dim=shape.head_dim, dtype=shape.dtype)
        for layer in range(shape.num_layers):
            seq.append(layer, captured.keys[layer], captured.values[layer])
        for layer in range(shape.num_layers):
            q = captured.queries[layer]  # [Hq, n, D]
            n = q.shape[1]
            res = store.query([seq] * n, layer, q.transpose(0, 1)[:, :, None], scale=scale)
            # the store answers on its executor's device, the model may be elsewhere
            got = res.out[:, :, 0].transpose(0, 1).to(q.device, torch.float64)  # [Hq, n, D]
            lse = res.lse[:, :, 0].transpose(0, 1).to(q.device, torch.float64)
            ref, lse_ref = _reference(q, captured.keys[layer], captured.values[layer], scale)
            out.append(LayerFidelity(
                task=task, method=method, layer=layer,
                rel_error=float((got - ref).norm() / ref.norm()),
                captured_mass=float(torch.exp(lse - lse_ref).mean()),
                exact_fraction=res.stats.exact_fraction,
                estimated_mass=res.stats.estimated_mass,
                context_tokens=int(captured.keys[layer].shape[1])))
    return out


def run_fidelity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 samples: list[Sample], methods: list[str], budget: float, *,
                 num_queries: int, base: Mapping[str, Any] | None = None,
                 ) -> Iterator[LayerFidelity]:
    """Per-layer fidelity of each method on each sample's prompt."""
    for sample in samples:
        captured = capture(model, tokenizer, sample, num_queries)
        for method in methods:
            yield from layer_fidelity(captured, method, budget, task=sample.task, model=model,
                                      base=base)
