"""benchmarks/e2e.py's ``full`` cache: full attention as serving engines run it.

On the CPU the flash kernel is replaced by its float32 reference (same arguments, same
meaning), so these check the cache's bookkeeping -- in-place writes, each row's start and
filled length, the static decode step a CUDA graph captures -- against transformers'
``DynamicCache``; the ``gpu`` tests check the CUDA kernel and the captured graph.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

from benchmarks.flash_varlen import SPLITS_SUPPORTED, flash_varlen, varlen_reference
from benchmarks.full_attention import ATTENTION_NAME, FullCache
from benchmarks.full_graph import DecodeGraph
from integrations.hf.cache import cache_kwarg
from tests.integrations.hf_models import generate, left_padded, tiny_model
from tests.syncs import HostSyncs
from vecstore.errors import CapacityError, IncompatibleError, ShapeError


def _rows(B, S, Hkv, G, D, L, starts, used, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B * L, Hkv * G, D, generator=gen).to(device, dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen).to(device, dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(device, dtype)
    cu_k = torch.tensor([b * S + s for b, s in enumerate(starts)] + [B * S], dtype=torch.int32,
                        device=device)
    cu_q = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k, torch.tensor(used, dtype=torch.int32, device=device)


@given(st.data())
def test_reference_attends_each_rows_filled_range_only(data):
    B, Hkv, G, D, S = data.draw(st.integers(1, 3)), 2, data.draw(st.sampled_from([1, 4])), 8, 24
    L = data.draw(st.integers(1, 5))
    causal = data.draw(st.booleans()) and L > 1
    starts = [data.draw(st.integers(0, 6)) for _ in range(B)]
    used = [data.draw(st.integers(L, S - s)) for s in starts]
    q, k, v, _, cu_k, seqused = _rows(B, S, Hkv, G, D, L, starts, used, torch.float64, "cpu")
    outside = torch.ones(B, S, 1, 1, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(starts, used, strict=True)):
        outside[b, s:s + n] = False
    k = k.masked_fill(outside & (torch.rand(B, S, 1, 1) < 0.5), float("nan"))  # never read
    got = varlen_reference(q, k, v, cu_k=cu_k, seqused=seqused, max_q=L, causal=causal,
                           scale=0.3).view(B, L, Hkv * G, D)
    for b, (s, n) in enumerate(zip(starts, used, strict=True)):
        kb = k[b, s:s + n].repeat_interleave(G, dim=1).transpose(0, 1)  # [Hq, n, D]
        vb = v[b, s:s + n].repeat_interleave(G, dim=1).transpose(0, 1)
        logits = q.view(B, L, -1, D)[b].transpose(0, 1) @ kb.transpose(1, 2) * 0.3
        if causal:  # query i is key n - L + i
            i, j = torch.arange(L)[:, None], torch.arange(n)[None, :]
            logits = logits.masked_fill(j > n - L + i, float("-inf"))
        want = (torch.softmax(logits, -1) @ vb).transpose(0, 1)
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-6)  # float32 inside


def test_generate_equals_dynamic_cache_with_left_padding():
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = left_padded([7, 12, 3], seed=1)
    want = generate(model, ids, DynamicCache(config=model.config), attention_mask=mask,
                    max_new_tokens=12, do_sample=False)
    with FullCache(model, 3, 40) as cache:
        assert model.config._attn_implementation == ATTENTION_NAME
        got = generate(model, ids, cache, attention_mask=mask, max_new_tokens=12,
                       do_sample=False)
        assert cache.get_seq_length() == 12 + 11
        assert cache.start.tolist() == [5, 0, 9]
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(got, want)


def test_chunked_prefill_equals_one_pass_of_dynamic_cache():
    model = tiny_model("llama", heads=4, kv_heads=1)
    kw = cache_kwarg(model)
    ids = torch.randint(3, 96, (2, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True, **{kw: DynamicCache(config=model.config)})
        with FullCache(model, 2, 64) as cache:
            got = torch.cat([model(input_ids=ids[:, s:s + 16], use_cache=True,
                                   **{kw: cache}).logits for s in range(0, 50, 16)], dim=1)
    torch.testing.assert_close(got, want.logits, rtol=1e-4, atol=1e-5)


def _prefill(model, cache, ids, mask):
    kw = cache_kwarg(model)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1, **{kw: cache})
    return out.logits.argmax(-1)


@pytest.mark.parametrize("compile_layers", [False, True])
def test_static_decode_step_equals_dynamic_cache_without_host_syncs(compile_layers):
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = left_padded([9, 4, 13], seed=3)
    want = generate(model, ids, DynamicCache(config=model.config), attention_mask=mask,
                    max_new_tokens=10, do_sample=False)[:, -10:]
    with FullCache(model, 3, 32) as cache, torch.no_grad():
        nxt = _prefill(model, cache, ids, mask)
        steps = [DecodeGraph(model, cache, compile_layers=compile_layers),
                 DecodeGraph(model, cache, num_splits=4, compile_layers=compile_layers)]
        assert not any(s.capture for s in steps)  # CPU: the static step runs eagerly
        tokens = [nxt]
        with HostSyncs() as syncs:
            for i in range(9):  # two steps (graphs on CUDA) taking turns on one cache
                nxt = steps[i % 2](nxt).argmax(-1)
                tokens.append(nxt)
        assert syncs.total == 0, dict(syncs.count)
        assert cache.get_seq_length() == 13 + 9
    assert torch.equal(torch.cat(tokens, dim=1), want)


def test_bad_input_is_refused_and_leaves_the_cache_as_it_was():
    model = tiny_model("llama")
    kw = cache_kwarg(model)
    ids = torch.randint(3, 96, (2, 6))
    with FullCache(model, 2, 8) as cache, torch.no_grad():
        with pytest.raises(IncompatibleError, match="left padding only"):
            right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
            model(input_ids=ids, attention_mask=right, use_cache=True, **{kw: cache})
        with pytest.raises(IncompatibleError, match="2-D"):
            dense = torch.ones(2, 1, 6, 6, dtype=torch.bool)
            model(input_ids=ids, attention_mask=dense, use_cache=True, **{kw: cache})
        with pytest.raises(ShapeError, match="holds 2 rows"):
            model(input_ids=ids[:1], use_cache=True, **{kw: cache})
        assert cache.get_seq_length() == 0
        left = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        model(input_ids=ids, attention_mask=left, use_cache=True, **{kw: cache})
        assert cache.get_seq_length() == 6 and cache.start.tolist() == [1, 0]
        with pytest.raises(CapacityError, match="larger max_len"):
            model(input_ids=ids[:, :3], use_cache=True, **{kw: cache})
        step = DecodeGraph(model, cache)
        with pytest.raises(ShapeError, match=r"decodes \(2, 1\) token ids"):
            step(ids[:1, :1])
        step(ids[:, :1])
        step(ids[:, :1])
        with pytest.raises(CapacityError, match="holds 8 tokens"):
            step(ids[:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 5])
def test_cuda_kernel_equals_reference(L):
    B, S, Hkv, G, D = 3, 300, 2, 4, 128
    starts, used = [0, 7, 40], [300, 120, 6]
    q, k, v, cu_q, cu_k, seqused = _rows(B, S, Hkv, G, D, L, starts, used, torch.bfloat16,
                                         "cuda")
    want = varlen_reference(q, k, v, cu_k=cu_k, seqused=seqused, max_q=L, causal=L > 1,
                            scale=D ** -0.5)
    for splits in (0, 3) if SPLITS_SUPPORTED else (0,):  # its own choice, then 3 parts
        got = flash_varlen(q, k, v, cu_q=cu_q, cu_k=cu_k, seqused=seqused, max_q=L,
                           causal=L > 1, scale=D ** -0.5, num_splits=splits)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_captured_step_equals_eager_static_step():
    model = tiny_model("llama", heads=4, kv_heads=2).to("cuda", torch.bfloat16)
    ids, mask = left_padded([9, 4, 13], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    runs = []
    for capture in (False, True):
        with FullCache(model, 3, 48) as cache, torch.no_grad():
            nxt = _prefill(model, cache, ids, mask)
            step, tokens = DecodeGraph(model, cache, capture=capture), [nxt]
            for _ in range(20):
                nxt = step(nxt).argmax(-1)
                tokens.append(nxt)
            runs.append(torch.cat(tokens, dim=1))
    assert torch.equal(runs[0], runs[1])
