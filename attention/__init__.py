"""The model-side attention layer that queries a vecstore store.

Framework-neutral: a binding (``integrations.hf`` for transformers) hands each attention
layer's post-RoPE ``q, k, v`` and the tokens' validity to :class:`StoreAttention`, which
prefills (exact attention over the stored prefix and the new tokens, then ingestion) or
decodes (append, then ``store.query``).
"""

from attention.decode import decode as decode
from attention.decode import ingest as ingest
from attention.decode import query_store as query_store
from attention.exact import causal_mask as causal_mask
from attention.exact import sdpa as sdpa
from attention.exact import sdpa_lower_right as sdpa_lower_right
from attention.gqa import group_size as group_size
from attention.gqa import repeat_kv as repeat_kv
from attention.prefill import prefill as prefill
from attention.store_attention import DecodeStats as DecodeStats
from attention.store_attention import StoreAttention as StoreAttention
from attention.varlen import varlen_attention as varlen_attention

__all__ = ["StoreAttention", "DecodeStats", "prefill", "decode", "ingest", "query_store",
           "sdpa", "sdpa_lower_right", "varlen_attention", "causal_mask", "group_size",
           "repeat_kv"]
