"""What ``benchmarks/e2e.py`` runs: the model and each cache with its decode step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from integrations.hf.cache import cache_kwarg

__all__ = ["MODELS", "build_model", "make_cache", "make_step", "greedy", "block_cache_hit_rate"]

MODELS = {  # hidden, q heads, KV heads, head dim, MLP, vocab
    "llama-3-8b": (4096, 32, 8, 128, 14336, 128256),
    "tiny": (64, 4, 2, 16, 128, 96),  # for runs on the CPU (tests)
}


def build_model(layers: int, shape: str = "llama-3-8b", device: str = "cuda"):
    """A bf16 Llama of ``layers`` layers, shaped as ``MODELS[shape]``, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, head_dim, mlp, vocab = MODELS[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=1 << 21, rope_theta=500000.0,
                      attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def make_cache(name: str, model, batch: int, length: int, *, compile_layers: bool = False,
               cache_capacity: float | None = None):
    """A fresh cache of kind ``name`` for ``batch`` rows that reach ``length`` tokens
    (``compile_layers``: a wave cache's decode steps run the layers compiled around their
    attention; ``full`` gets them from :func:`make_step`; ``cache_capacity``: the
    ``wave-pinned`` block caches' ``cache.capacity``, ``None`` for the default)."""
    from transformers import DynamicCache, StaticCache

    from benchmarks.full_attention import FullCache
    from integrations.hf import WaveCache

    device = next(model.parameters()).device
    if name == "full":
        return FullCache(model, batch, length)
    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    # executor kind "auto": the wave executor on CUDA, the torch reference on the CPU;
    # on CUDA the WaveCache captures its decode forward in one CUDA graph by default
    config: dict = {"executor": {"device": str(device)}}
    if name == "wave-pinned":  # the default config's prefill mirror included
        config["kvstore"] = {"kind": "pinned"}
        if cache_capacity is not None:
            config["cache"] = {"capacity": cache_capacity}
    return WaveCache(config, model, cuda_graphs=True if compile_layers else None,
                     compile_layers=compile_layers)


def block_cache_hit_rate(name: str, cache) -> float | None:
    """The share of retrieved clusters the block caches of cache ``name`` served over every
    step so far: ``wave-pinned``'s where its executor is the wave executor (it is the torch
    reference on a CPU), else ``None``."""
    from vecstore.executor.wave_exec import WaveExecutor

    executor = cache.store.executor if name == "wave-pinned" else None
    return executor.buffer_stats().hit_rate if isinstance(executor, WaveExecutor) else None


def make_step(name: str, model, cache, num_splits: int = 0, *, compile_layers: bool = False
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decode step of ``cache``: next token ids ``[B, 1]`` from the last ones (``full``:
    a CUDA graph whose flash decoding splits each row's keys in ``num_splits``, its layers
    compiled around their attention with ``compile_layers``)."""
    if name == "full":
        from benchmarks.full_graph import DecodeGraph

        graph = DecodeGraph(model, cache, num_splits=num_splits, compile_layers=compile_layers)
        return lambda nxt: greedy(graph(nxt)[:, -1])
    kwarg = cache_kwarg(model)

    def step(nxt: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{kwarg: cache})
        return greedy(out.logits[:, -1])

    return step


def greedy(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The next token ids ``[B, 1]`` of ``logits [B, V]``: ``logits.argmax(-1)``, as the
    maxima of ``chunk``-wide pieces and then of those (the first index of the maximum, as
    ``argmax``). With a few rows one ``argmax`` over a vocabulary runs a handful of blocks:
    H200, 128,256 tokens at batch 8, 19 us against 40 (``results/projections.md``).

    Examples
    --------
    >>> x = torch.tensor([[0.0, 3.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0, 5.0]])
    >>> greedy(x, chunk=2).tolist()
    [[1], [0]]
    """
    b, v = logits.shape
    pad = -v % chunk
    x = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    val, idx = x.reshape(b, -1, chunk).max(-1)
    best = val.argmax(-1, keepdim=True)
    return best * chunk + idx.gather(1, best)
