"""Shared helpers of the persistence tests: small configs, deterministic token streams,
and a token-multiset view of a stored layer (segments keep rows in cluster order)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch

from vecstore import Sequence, Store

SMALL = {"index": {"tokens_per_cluster": 4, "segment_tokens": 32},
         "attention": {"sink_tokens": 3, "window_tokens": 5, "update_tokens": 7,
                       "retrieval_budget": 0.3, "estimation_budget": 0.5}}
"""Tiny segments, so a few hundred tokens exercise sinks, many segments and the tail."""

HEADS, DIM, LAYERS = 2, 8, 2


def config(kind: str = "wave") -> dict:
    return {**SMALL, "index": {**SMALL["index"], "kind": kind}}


def stream(seed: int, layer: int, n: int, dtype: torch.dtype = torch.float16,
           heads: int = HEADS, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` tokens of a deterministic ``[H, n, D]`` key/value stream (token
    ``p`` is the same whatever ``n``)."""
    gen = torch.Generator().manual_seed(1000 * seed + layer)
    kv = torch.randn(n, 2, heads, dim, generator=gen).to(dtype)  # [n, 2, H, D]
    return kv[:, 0].transpose(0, 1).contiguous(), kv[:, 1].transpose(0, 1).contiguous()


def fill(seq: Sequence, seed: int, chunks: list[int]) -> int:
    """Append the stream in ``chunks`` (prefill then decode) to every layer."""
    total = sum(chunks)
    streams = [stream(seed, layer, total, seq.dtype, seq.num_kv_heads, seq.head_dim)
               for layer in range(seq.num_layers)]
    at = 0
    for n in chunks:
        for layer, (k, v) in enumerate(streams):
            seq.append(layer, k[:, at:at + n], v[:, at:at + n])
        at += n
    return total


def stored_rows(seq: Sequence, layer: int) -> torch.Tensor:
    """Every stored (key, value) row of ``layer``, per head, sorted: ``[H, T, 2D]``
    float32, comparable with :func:`expected_rows` whatever the cluster order."""
    state = seq.layers[layer]
    keys = torch.cat([state.sink_keys, *(s.keys for s in state.segments), state.pending_keys], 1)
    vals = torch.cat([state.sink_values, *(s.values for s in state.segments),
                      state.pending_values], 1)
    return _sorted_rows(torch.cat([keys, vals], dim=-1).float())


def expected_rows(seed: int, layer: int, n: int, dtype: torch.dtype = torch.float16,
                  heads: int = HEADS, dim: int = DIM) -> torch.Tensor:
    k, v = stream(seed, layer, n, dtype, heads, dim)
    return _sorted_rows(torch.cat([k, v], dim=-1).float())


def _sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    # rows are random, hence distinct: unique() is a lexicographic sort
    return torch.stack([torch.unique(r, dim=0) for r in rows])


def queries(seq: Sequence, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2 * seq.num_kv_heads, 3, seq.head_dim, generator=gen).to(seq.dtype)


def answers(seq: Sequence) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """``(out, lse, stats)`` of every layer for fixed queries."""
    q = queries(seq)
    out = []
    for layer in range(seq.num_layers):
        r = seq.query(layer, q)
        out.append((r.out.clone(), r.lse.clone(), r.stats))
    return out


def build(path: Path, kind: str = "wave", dtype: torch.dtype = torch.float16,
          chunks: tuple[int, ...] = (150, 1, 1, 9, 40, 1, 3)) -> list:
    """A store with two sequences; returns the answers of the first."""
    with Store.open(path, config(kind)) as store:
        a = store.create("a", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype,
                         fingerprint="model-x")
        fill(a, 1, list(chunks))
        b = store.create("b", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype)
        fill(b, 2, [20])
        return answers(a)


def data_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "data").rglob("*.safetensors"))


@cache
def _template() -> tuple[Path, tuple]:
    root = Path(tempfile.mkdtemp(prefix="vecstore-template-")) / "s"
    atexit.register(shutil.rmtree, root.parent, True)
    return root, tuple(build(root))


def built_copy(path: Path) -> list:
    """A copy at ``path`` of the store :func:`build` makes (built once per process);
    returns the first sequence's answers."""
    root, before = _template()
    shutil.copytree(root, path)
    return list(before)
