"""Helpers of the transformers-integration tests: tiny random models, small store configs."""

from __future__ import annotations

import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from integrations.hf.cache import cache_kwarg

# Small zones so that 100-token prompts are indexed and decoding crosses update_tokens.
SMALL = {"index": {"tokens_per_cluster": 4, "segment_tokens": 64},
         "attention": {"sink_tokens": 2, "window_tokens": 8, "update_tokens": 16}}
EXACT = {**SMALL, "attention": {**SMALL["attention"], "retrieval_budget": 1.0}}


def tiny_model(arch: str = "llama", heads: int = 4, kv_heads: int = 2, seed: int = 0,
               layers: int = 2) -> PreTrainedModel:
    """A random-initialised decoder (no download), in eval mode."""
    torch.manual_seed(seed)
    cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                      "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, pad_token_id=0,
              eos_token_id=1, bos_token_id=2, max_position_embeddings=1024)
    return model_cls(cfg).eval()


# (config class, model class, settings) of the architectures the integration is tested on;
# sliding windows of 24 tokens, shorter than the prompts, so the windows slide. Gemma 2
# soft-caps its logits as it ships, at 2.0 rather than 50.0, with scores large enough
# (initializer_range, query_pre_attn_scalar) that the cap changes the greedy tokens
# (test_architectures checks it): a run that ignored the cap would not match
ARCHITECTURES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "sliding_window": 24, "head_dim": 16, "attn_logit_softcapping": 2.0,
        "initializer_range": 0.1, "query_pre_attn_scalar": 1}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": 24, "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"]}),
}


def arch_model(arch: str, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A tiny random model (2 layers, hidden 64, 4 query / 2 KV heads) of ``arch``."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    settings = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                    eos_token_id=1, bos_token_id=2, max_position_embeddings=1024)
    cfg = getattr(transformers, config_cls)(**{**settings, **extra, **overrides})
    return getattr(transformers, model_cls)(cfg).eval()


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths`` tokens, left-padded: ``input_ids``, ``attention_mask``."""
    gen = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(3, 96, (n,), generator=gen)
        mask[b, T - n:] = 1
    return ids, mask


def generate(model: PreTrainedModel, ids: torch.Tensor, cache: object, **kwargs: object
             ) -> torch.Tensor:
    """``model.generate`` with ``cache`` under the argument name this transformers uses."""
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    with torch.no_grad():
        return model.generate(ids, pad_token_id=0, **{cache_kwarg(model): cache}, **kwargs)
