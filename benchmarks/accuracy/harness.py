"""Run the tasks on the real model with every method, sharing one prefill per sample.

Prefill is exact for every method (``WaveCache`` computes it with SDPA and only then
ingests the KV), so each sample is prefilled once with transformers' ``DynamicCache``:
its first answer token comes from exact logits, as it would with any method. Each
method then gets the prefill's KV in a fresh store of its own configuration (``full``
gets a fresh ``DynamicCache``) and decodes the rest of the answer greedily; sparse
methods are compared at the same retrieval budget, i.e. the same number of tokens read
exactly per step (steady zone + retrieved units of ~16 tokens), which is measured and
reported with every score.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from integrations.hf.cache import WaveCache, cache_kwarg
from integrations.hf.install import model_fingerprint, model_shape
from integrations.tasks import Sample, score
from vecstore import Store

__all__ = ["METHODS", "Prefilled", "Result", "method_config", "prefill", "run_method",
           "run_sample", "plan_runs"]

METHODS = ("full", "wave", "wave_noest", "quest", "sink_window", "topk_oracle")
"""``full`` (transformers' cache), ``wave`` (default budgets), ``wave_noest`` (estimation
budget 0), and the baselines ``quest``, ``sink_window``, ``topk_oracle``."""


def method_config(method: str, budget: float,
                  base: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Store configuration of ``method`` at retrieval budget ``budget`` (``None`` = full).

    ``base`` holds further settings (e.g. ``{"index": {"tokens_per_cluster": 8}}``);
    the method's index kind and budgets take precedence over it.

    Examples
    --------
    >>> method_config("wave_noest", 0.018)["attention"]
    {'retrieval_budget': 0.018, 'estimation_budget': 0.0}
    >>> method_config("quest", 0.01, {"index": {"page_tokens": 8}})["index"]
    {'page_tokens': 8, 'kind': 'quest'}
    """
    if method == "full":
        return None
    config = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (base or {}).items()}
    index = config.setdefault("index", {})
    attention = config.setdefault("attention", {})
    index["kind"] = "wave" if method.startswith("wave") else method
    attention["retrieval_budget"] = budget
    if method == "wave_noest":
        attention["estimation_budget"] = 0.0
    return config


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A sample's prompt after one exact prefill.

    Attributes
    ----------
    ids : torch.Tensor
        ``[1, T]`` prompt token ids.
    first : int
        First answer token (from the exact prefill logits).
    keys, values : list[torch.Tensor]
        Per layer, ``[1, Hkv, T, D]`` post-RoPE KV of the prompt.
    seconds : float
        Prefill time.
    """

    ids: torch.Tensor
    first: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    seconds: float


@dataclass(frozen=True, slots=True)
class Result:
    """One method's answer to one sample.

    Attributes
    ----------
    task, length, seed, method, budget
        What was run (``budget`` is the retrieval budget; 0 for ``full``).
    score : float
        Share of expected strings found.
    answer : str
        The decoded answer.
    prompt_tokens : int
        Prompt length in tokens.
    exact_fraction : float
        Share of the context read exactly per decode query (1.0 for ``full``).
    estimated_mass : float
        Mean share of softmax mass carried by the estimation zone.
    seconds : float
        Index build plus decode time.
    """

    task: str
    length: int
    seed: int
    method: str
    budget: float
    score: float
    answer: str
    prompt_tokens: int
    exact_fraction: float
    estimated_mass: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def prefill(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
            sample: Sample) -> Prefilled:
    """Prefill ``sample``'s prompt exactly and keep its KV."""
    device = next(model.parameters()).device
    ids = tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(device)
    start = time.perf_counter()
    cache = DynamicCache()
    logits = model(ids, **{cache_kwarg(model): cache}, use_cache=True).logits
    first = int(logits[0, -1].argmax())
    return Prefilled(ids=ids, first=first, keys=[layer.keys for layer in cache.layers],
                     values=[layer.values for layer in cache.layers],
                     seconds=time.perf_counter() - start)


@torch.no_grad()
def _continue(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pre: Prefilled,
              cache: Any, max_new_tokens: int) -> str:
    tokens = [pre.first]
    eos = tokenizer.eos_token_id
    if pre.first != eos and max_new_tokens > 1:
        ids = torch.cat([pre.ids, pre.ids.new_tensor([[pre.first]])], dim=1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens - 1, do_sample=False,
                             pad_token_id=eos, **{cache_kwarg(model): cache})
        tokens += out[0, ids.shape[1]:].tolist()
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def run_method(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sample: Sample,
               pre: Prefilled, method: str, budget: float, *, fingerprint: str,
               base: Mapping[str, Any] | None = None) -> Result:
    """Decode ``sample``'s answer with ``method`` (on top of settings ``base``) from the
    shared prefill."""
    start = time.perf_counter()
    config = method_config(method, budget, base)
    exact, mass = 1.0, 0.0
    if config is None:
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(pre.keys, pre.values, strict=True)):
            cache.update(k, v, layer)
        answer = _continue(model, tokenizer, pre, cache, sample.max_new_tokens)
    else:
        shape = model_shape(model)
        with Store.open(config=config) as store:
            seq = store.create("sample", num_layers=shape.num_layers,
                               num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                               dtype=shape.dtype, fingerprint=fingerprint)
            for layer, (k, v) in enumerate(zip(pre.keys, pre.values, strict=True)):
                seq.append(layer, k[0], v[0])
            with WaveCache.from_store(store, "sample", model) as cache:
                answer = _continue(model, tokenizer, pre, cache, sample.max_new_tokens)
                stats = cache.decode_stats
            if stats.queries:
                exact, mass = stats.exact_fraction, stats.estimated_mass
    return Result(task=sample.task, length=sample.length, seed=sample.seed, method=method,
                  budget=0.0 if config is None else budget,
                  score=score(answer, sample.answers), answer=answer,
                  prompt_tokens=int(pre.ids.shape[1]), exact_fraction=exact,
                  estimated_mass=mass, seconds=time.perf_counter() - start)


def run_sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sample: Sample,
               runs: list[tuple[str, float]], *,
               base: Mapping[str, Any] | None = None) -> Iterator[Result]:
    """Prefill ``sample`` once, then answer it with each ``(method, budget)`` of ``runs``."""
    pre = prefill(model, tokenizer, sample)
    fingerprint = model_fingerprint(model)
    for method, budget in runs:
        yield run_method(model, tokenizer, sample, pre, method, budget,
                         fingerprint=fingerprint, base=base)


def plan_runs(methods: list[str], budget: float, sweep_methods: list[str],
              sweep_budgets: list[float], *, swept: bool) -> list[tuple[str, float]]:
    """The ``(method, budget)`` pairs one sample is answered with.

    Examples
    --------
    >>> plan_runs(["full", "wave"], 0.018, ["wave"], [0.005, 0.018], swept=True)
    [('full', 0.0), ('wave', 0.018), ('wave', 0.005)]
    """
    runs = [(m, 0.0 if m == "full" else budget) for m in methods]
    if swept:
        runs += [(m, b) for m in sweep_methods for b in sweep_budgets
                 if m != "full" and (m, b) not in runs]
    return runs
