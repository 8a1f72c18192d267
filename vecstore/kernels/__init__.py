"""Decode kernels for one query token per sequence: Triton on CUDA, plain torch elsewhere.

Each kernel returns float32 results and takes ``backend="auto" | "triton" | "torch"``:

- :func:`score_centroids` — centroid logits and each KV head's top clusters (index probe);
- :func:`estimate_zone` — the estimation zone's attention state from centroids and value sums;
- :func:`sparse_decode_attention` — exact attention over gathered buffers (split-K);
- :func:`sparse_attention_by_clusters` — exact attention over clusters read in place;
- :func:`merge_states` — exact log-sum-exp merge of two attention states.

Importing this package does not import Triton.
"""

from vecstore.kernels.centroid_topk import score_centroids as score_centroids
from vecstore.kernels.centroid_topk import select_top as select_top
from vecstore.kernels.estimate import estimate_zone as estimate_zone
from vecstore.kernels.merge import merge_states as merge_states
from vecstore.kernels.sparse_attention import (
    sparse_attention_by_clusters as sparse_attention_by_clusters,
)
from vecstore.kernels.sparse_attention import sparse_decode_attention as sparse_decode_attention

__all__ = [
    "estimate_zone",
    "merge_states",
    "score_centroids",
    "select_top",
    "sparse_attention_by_clusters",
    "sparse_decode_attention",
]
