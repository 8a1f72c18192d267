"""score_centroids: logits and group top-k against the float64 reference, on both backends."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DTYPES, SHAPES, TOLERANCE, poisoned, ref_centroid_scores, rel_l2

from vecstore.errors import InvalidValueError, ShapeError
from vecstore.kernels import score_centroids, select_top


def _inputs(batch, num_kv, group, dim, num_clusters, dtype, gen):
    q = torch.randn(batch, num_kv * group, dim, generator=gen).to(dtype)
    centroids = torch.randn(batch, num_kv, num_clusters, dim, generator=gen).to(dtype)
    sizes = torch.randint(0, 24, (batch, num_kv, num_clusters), generator=gen, dtype=torch.int32)
    centroids[sizes == 0] = float("nan")  # padding clusters may hold anything
    return q, centroids, sizes


def _check(q, centroids, sizes, scale, k, logits, top_ids, tol):
    ref_logits, ref_score = ref_centroid_scores(q, centroids, sizes, scale)
    logits, top_ids, sizes = logits.cpu(), top_ids.cpu(), sizes.cpu()
    assert logits.dtype == torch.float32 and top_ids.dtype == torch.int64
    assert not torch.isnan(logits).any()
    empty = torch.isneginf(ref_logits)
    assert torch.equal(torch.isneginf(logits), empty)
    assert rel_l2(logits[~empty], ref_logits[~empty]) < tol
    num_valid = (sizes > 0).sum(-1)  # [B, Hkv]
    for b in range(top_ids.shape[0]):
        for h in range(top_ids.shape[1]):
            ids = top_ids[b, h]
            take = min(k, int(num_valid[b, h]))
            assert torch.all(ids[take:] == -1), "the tail past the valid clusters must be -1"
            chosen = ids[:take]
            assert len(set(chosen.tolist())) == take and torch.all(sizes[b, h, chosen] > 0)
            # The chosen clusters carry the k best scores, best first (ties in any order).
            want = ref_score[b, h].topk(take).values
            torch.testing.assert_close(ref_score[b, h, chosen], want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(target, gen, shape, dtype):
    batch, num_kv, group, dim = shape
    q, centroids, sizes = _inputs(batch, num_kv, group, dim, 151, dtype, gen)
    scale, k = dim**-0.5, 37
    out = poisoned(
        ((batch, num_kv * group, 151), torch.float32),
        ((batch, num_kv, k), torch.int64),
        device=target.device,
    )
    dev = [t.to(target.device) for t in (q, centroids, sizes)]
    logits, top_ids = score_centroids(*dev, scale, k, backend=target.backend, out=out)
    assert logits is out[0] and top_ids is out[1]
    _check(q, centroids, sizes, scale, k, logits, top_ids, TOLERANCE[dtype])


def test_empty_rows_and_k_past_valid(target, gen):
    q, centroids, sizes = _inputs(2, 2, 3, 64, 70, torch.bfloat16, gen)
    sizes[0, 1] = 0  # one KV head with no cluster at all
    sizes[1, 0, 5:] = 0  # and one with only five
    centroids[sizes == 0] = float("nan")
    dev = [t.to(target.device) for t in (q, centroids, sizes)]
    logits, top_ids = score_centroids(*dev, 0.125, 20, backend=target.backend)
    _check(q, centroids, sizes, 0.125, 20, logits, top_ids, TOLERANCE[torch.bfloat16])
    assert torch.all(top_ids[0, 1] == -1) and torch.all(torch.isneginf(logits[0, 3:6]))


def test_k_zero_and_all(target, gen):
    q, centroids, sizes = _inputs(1, 1, 4, 64, 40, torch.float32, gen)
    dev = [t.to(target.device) for t in (q, centroids, sizes)]
    assert score_centroids(*dev, 0.125, 0, backend=target.backend)[1].shape == (1, 1, 0)
    logits, top_ids = score_centroids(*dev, 0.125, 40, backend=target.backend)
    _check(q, centroids, sizes, 0.125, 40, logits, top_ids, TOLERANCE[torch.float32])


def test_select_top_marks_excluded():
    score = torch.tensor([[0.5, float("-inf"), 0.25, 0.0]])
    assert select_top(score, 4).tolist() == [[0, 2, 3, -1]]
    with pytest.raises(ShapeError):
        select_top(score, 5)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"k": 99}, InvalidValueError),
        ({"k": -1}, InvalidValueError),
        ({"scale": 0.0}, InvalidValueError),
        ({"q": torch.randn(1, 3, 8)}, ShapeError),  # 3 query heads over 2 KV heads
        ({"centroids": torch.randn(1, 2, 5, 8, dtype=torch.float16)}, ShapeError),
        ({"sizes": torch.ones(1, 2, 5)}, ShapeError),  # float sizes
        ({"backend": "cuda"}, InvalidValueError),
    ],
)
def test_rejects_bad_arguments(change, error):
    args = {
        "q": torch.randn(1, 4, 8),
        "centroids": torch.randn(1, 2, 5, 8),
        "sizes": torch.ones(1, 2, 5, dtype=torch.int64),
        "scale": 0.5,
        "k": 2,
        "backend": "torch",
    }
    args.update(change)
    with pytest.raises(error):
        score_centroids(**args)
