"""The estimation zone: exact for clusters of identical keys, a lower bound (Jensen) always."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.reference import exact_attention, rel_err
from vecstore import Store
from vecstore.config import StoreConfig
from vecstore.executor.torch_ref import estimate_units
from vecstore.index.base import IndexView, UnitSummary
from vecstore.index.wave import WaveIndex
from vecstore.kernels.reference import merge


def _wave_view(keys: torch.Tensor, values: torch.Tensor,
               tpc: int) -> tuple[IndexView, UnitSummary]:
    cfg = StoreConfig.from_dict({"index": {"tokens_per_cluster": tpc, "segment_tokens": 4096}})
    index = WaveIndex(cfg)
    view = IndexView.from_segments(index.build(keys, values, 0))
    return view, index.summarize(view)


@given(heads=st.integers(1, 3), distinct=st.integers(1, 12), repeat=st.integers(1, 6),
       group=st.sampled_from([1, 2, 4]), seed=st.integers(0, 9999))
def test_clusters_of_identical_keys_make_the_estimate_exact(heads, distinct, repeat, group, seed):
    gen = torch.Generator().manual_seed(seed)
    base = 2.0 * torch.randn(heads, distinct, 8, generator=gen, dtype=torch.float64).float()
    keys = base.repeat_interleave(repeat, dim=1)
    values = torch.randn(heads, distinct * repeat, 8, generator=gen)
    q = torch.randn(heads * group, 1, 8, generator=gen)
    view, summary = _wave_view(keys, values, repeat)
    every = torch.arange(view.sizes.shape[-1])[None, None].expand(1, heads, -1)
    ids = every.masked_fill(view.sizes == 0, -1)
    out, lse = estimate_units(view, summary, ids, q.reshape(1, heads, group, 1, 8), 8 ** -0.5)
    ref_out, ref_lse = exact_attention(q, keys, values)
    assert rel_err(out.reshape(heads * group, 1, 8), ref_out) < 1e-4
    assert torch.allclose(lse.reshape(heads * group, 1).double(), ref_lse, atol=1e-4)


@given(tokens=st.integers(2, 200), tpc=st.integers(1, 20), scale=st.floats(0.05, 3.0),
       seed=st.integers(0, 9999))
def test_estimated_denominator_never_exceeds_the_true_one(tokens, tpc, scale, seed):
    """n_j e^{s q·c_j} <= sum_i e^{s q·k_i} for the mean centroid c_j (convexity of exp)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, tokens, 8, generator=gen)
    values = torch.randn(2, tokens, 8, generator=gen)
    q = torch.randn(2, 1, 8, generator=gen)
    view, summary = _wave_view(keys, values, tpc)
    ids = torch.arange(view.sizes.shape[-1])[None, None].expand(1, 2, -1)
    ids = ids.masked_fill(view.sizes == 0, -1)
    _, lse_est = estimate_units(view, summary, ids, q.reshape(1, 2, 1, 1, 8), scale)
    _, lse_true = exact_attention(q, keys, values, scale)
    assert (lse_est.reshape(2, 1).double() <= lse_true + 1e-4).all()
    # per cluster as well
    sizes = view.sizes[0].double()
    for h in range(2):
        for j in torch.nonzero(sizes[h]).flatten().tolist():
            a, b = int(view.offsets[0, h, j]), int(view.offsets[0, h, j + 1])
            true = torch.logsumexp(scale * view.keys[0, h, a:b].double() @ q[h, 0].double(), 0)
            est = scale * summary.centroids[0, h, j].double() @ q[h, 0].double()
            assert est + sizes[h, j].log() <= true + 1e-4


@given(tokens=st.integers(1, 120), cut=st.data(), seed=st.integers(0, 9999))
def test_lse_merge_of_any_split_equals_attention_over_all(tokens, cut, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, tokens, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(1, tokens, 8, generator=gen, dtype=torch.float64)
    q = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
    perm = torch.randperm(tokens, generator=gen)
    k = cut.draw(st.integers(0, tokens))
    a, b = perm[:k], perm[k:]
    out_a, lse_a = exact_attention(q, keys[:, a], values[:, a]) if k else (
        torch.zeros(3, 2, 8, dtype=torch.float64), torch.full((3, 2), float("-inf")).double())
    out_b, lse_b = exact_attention(q, keys[:, b], values[:, b]) if k < tokens else (
        torch.zeros(3, 2, 8, dtype=torch.float64), torch.full((3, 2), float("-inf")).double())
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = exact_attention(q, keys, values)
    assert torch.allclose(out, ref_out, atol=1e-10)
    assert torch.allclose(lse, ref_lse, atol=1e-10)


def test_estimation_lowers_error_on_structured_keys():
    """On Gaussian-mixture keys, estimating the unretrieved clusters beats dropping them."""
    from tests.reference import clustered_keys
    gen = torch.Generator().manual_seed(11)
    keys = clustered_keys(2, 4000, 32, 64, 0.3, gen)
    values = torch.randn(2, 4000, 32, generator=gen)
    q = keys[:, torch.randint(0, 4000, (3,), generator=gen)].reshape(6, 1, 32) * 0.3
    errors = {}
    for est in (0.0, 1.0):
        cfg = {"attention": {"estimation_budget": est, "retrieval_budget": 0.02}}
        with Store.open(config=cfg) as store:
            seq = store.create("s", num_layers=1, num_kv_heads=2, head_dim=32,
                               dtype=torch.float32)
            seq.append(0, keys, values)
            errors[est] = rel_err(seq.query(0, q).out, exact_attention(q, keys, values)[0])
    assert errors[1.0] < errors[0.0]
