"""Compiled Triton kernels on a CUDA device, at the Llama-3-8B attention shape (skipped on CPU).

Shapes stay modest (a few thousand clusters) so the tests run in seconds; the benchmark script
covers 128K and 1M contexts.
"""

from __future__ import annotations

import pytest
import torch
from kernel_refs import TOLERANCE, assert_state_close, ref_attention_rows, ref_estimate, rel_l2

from vecstore.kernels import (
    estimate_zone,
    merge_states,
    score_centroids,
    sparse_attention_by_clusters,
    sparse_decode_attention,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

B, HQ, HKV, D = 2, 32, 8, 128
SCALE = D**-0.5


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


def test_score_and_estimate_llama_shape(gen):
    num_clusters, k = 4096, 300
    q = torch.randn(B, HQ, D, generator=gen).bfloat16()
    centroids = torch.randn(B, HKV, num_clusters, D, generator=gen).bfloat16()
    sizes = torch.randint(1, 32, (B, HKV, num_clusters), generator=gen)
    sizes[:, :, -100:] = 0
    logits, top_ids = score_centroids(*_cuda(q, centroids, sizes), SCALE, k)
    _, ref_ids = score_centroids(q, centroids, sizes, SCALE, k, backend="torch")
    ref_logits = (
        torch.einsum(
            "bhd,bhcd->bhc", q.double(), centroids.double().repeat_interleave(HQ // HKV, 1)
        )
        * SCALE
    )
    valid = torch.isfinite(logits.cpu())
    assert rel_l2(logits.cpu()[valid], ref_logits[valid]) < 1e-5
    overlap = (top_ids.cpu().sort(-1).values == ref_ids.sort(-1).values).float().mean()
    assert overlap > 0.99  # same sets up to near-ties
    value_sums = sizes[..., None] * torch.randn(B, HKV, num_clusters, D, generator=gen)
    value_sums = value_sums.bfloat16()
    est_ids = top_ids.cpu()
    out, lse = estimate_zone(*_cuda(logits.cpu(), sizes, value_sums, est_ids))
    ref = ref_estimate(logits.cpu(), sizes, value_sums, est_ids)
    assert_state_close(out, lse, *ref, TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_attention_llama_shape(gen, dtype):
    num_rows = 3001
    q = torch.randn(B, HQ, D, generator=gen).to(dtype)
    keys = torch.randn(B, HKV, num_rows, D, generator=gen).to(dtype)
    values = torch.randn(B, HKV, num_rows, D, generator=gen).to(dtype)
    lengths = torch.randint(0, num_rows + 1, (B, HKV), generator=gen)
    lengths[0, 0] = 0
    out, lse = sparse_decode_attention(*_cuda(q, keys, values, lengths), SCALE)
    rows = [[list(range(int(n))) for n in row] for row in lengths]
    assert_state_close(
        out, lse, *ref_attention_rows(q, keys, values, rows, SCALE), TOLERANCE[dtype]
    )
    # Every row as 16-row clusters read in place gives exact full attention.
    starts = torch.arange(0, num_rows, 16).expand(B, HKV, -1).contiguous()
    counts = torch.clamp(num_rows - starts, max=16)
    out, lse = sparse_attention_by_clusters(*_cuda(q, keys, values, starts, counts), SCALE)
    full = [[list(range(num_rows))] * HKV] * B
    assert_state_close(
        out, lse, *ref_attention_rows(q, keys, values, full, SCALE), TOLERANCE[dtype]
    )


def test_cuda_graph_capture(gen):
    num_clusters, num_rows, k = 1024, 512, 64
    q, centroids, keys, values = _cuda(
        torch.randn(B, HQ, D, generator=gen).bfloat16(),
        torch.randn(B, HKV, num_clusters, D, generator=gen).bfloat16(),
        torch.randn(B, HKV, num_rows, D, generator=gen).bfloat16(),
        torch.randn(B, HKV, num_rows, D, generator=gen).bfloat16(),
    )
    sizes = torch.full((B, HKV, num_clusters), 16, device="cuda")
    value_sums = 16 * torch.randn(B, HKV, num_clusters, D, device="cuda").bfloat16()
    lengths = torch.full((B, HKV), num_rows, device="cuda")

    def step():
        logits, top_ids = score_centroids(q, centroids, sizes, SCALE, k)
        est = estimate_zone(logits, sizes, value_sums, top_ids)
        exact = sparse_decode_attention(q, keys, values, lengths, SCALE)
        return merge_states(*exact, *est)

    expected = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[0], expected[0])
    torch.testing.assert_close(captured[1], expected[1])
