"""API fuzzing: any call with any arguments either succeeds or raises a vecstore error,
and a call that raised left the store as it was (names, token counts, a fixed query's
output, every byte of its directory).

Run with ``--hypothesis-show-statistics`` for the outcome of every call by kind."""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.vecstore.persistence.dirstate import snapshot
from tests.vecstore.persistence.persist_helpers import config
from vecstore import Store
from vecstore.errors import VecstoreError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

bad_ints = st.one_of(st.integers(-2, 5), st.sampled_from([0, 4097, 2**40, 2**62, 2**64]),
                     st.booleans(), st.floats(allow_nan=True), st.text(max_size=2), st.none())
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, "float32", "float16",
                          torch.float64, torch.int8, "bf16", "int8", None, 3])
devices = st.sampled_from(["cpu", torch.device("cpu"), "cpu:0", None, None, "cuda", "cuda:0",
                           "cuda:abc", "meta", "bogus", "mps", 123])
names = st.one_of(st.sampled_from(["a", "a", "b", "c", "a\n", "", ".", "..", "x" * 129, "../e",
                                   "-a", "a b"]), st.text(max_size=8))
values = st.one_of(bad_ints, st.floats(-2, 2), st.text(max_size=4), st.booleans())
keys = st.sampled_from(["kind", "tokens_per_cluster", "segment_tokens", "sink_tokens",
                        "window_tokens", "retrieval_budget", "estimation_budget", "policy",
                        "capacity", "device", "seed", "exact", "bogus"])
sections = st.sampled_from(["index", "attention", "cache", "executor", "cluster", "kvstore",
                            "layers", "bogus"])
configs = st.one_of(st.none(), st.dictionaries(sections, st.one_of(
    st.dictionaries(keys, values, max_size=2), values), max_size=2), st.sampled_from(
    [3, "missing.toml", [], {"layers": {"0": {"exact": True}}}]))


@st.composite
def tensors(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype, good: bool) -> Any:
    """A random tensor of ``shape`` and ``dtype``, or (not ``good``) one with some other
    shape, dtype, device or values, or no tensor at all."""
    if good:
        return torch.randn(shape).to(dtype)
    what = draw(st.sampled_from(["shape", "dtype", "meta", "nan", "inf", "object"]))
    if what == "object":
        return draw(st.sampled_from([None, [[1.0]], 3]))
    if what == "shape":
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    if what == "dtype":
        dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64,
                                      torch.int64]))
    x = (torch.randint(0, 3, shape) if not dtype.is_floating_point
         else torch.randn(shape)).to(dtype)
    if what in ("nan", "inf") and x.numel():
        x.view(-1)[0] = float(what)
    return x.to("meta") if what == "meta" else x


def _state(store: Store, root: Path) -> tuple:
    out = []
    for name in store.sequences():
        seq = store.sequence(name)
        counts = tuple(seq.tokens(i) for i in range(seq.num_layers))
        answer = None
        if counts[0]:
            q = torch.ones(seq.num_kv_heads, 1, seq.head_dim, dtype=seq.dtype)
            answer = tuple(seq.query(0, q).out.float().flatten().tolist())
        out.append((name, counts, answer))
    return tuple(out), snapshot(root)


class _Args:
    """Draws a call's arguments: all valid, or all but one (named at random) valid."""

    def __init__(self, data: st.DataObject, names: list[str]) -> None:
        self.data = data
        self.bad = data.draw(st.sampled_from([None] * len(names) + names))

    def __call__(self, name: str, good: st.SearchStrategy, bad: st.SearchStrategy) -> Any:
        return self.data.draw(bad if name == self.bad else good)


def _op(data: st.DataObject, store: Store, root: Path) -> tuple[str, Callable[[], object]]:
    kind = data.draw(st.sampled_from(["open", "create", "append", "query", "search", "drop",
                                      "place", "transaction"]))
    live = sorted(store._seqs)
    if kind == "open":
        arg = _Args(data, ["path", "config"])
        where = arg("path", st.sampled_from(["store", "new"]),
                    st.sampled_from(["store/sub", "file", "", "\x00", 42]))
        path = {"store": root, "store/sub": root / "data", "file": root / "catalog.sqlite",
                "new": root.parent / "new"}.get(where, where)
        cfg, ro = arg("config", st.none(), configs), data.draw(st.booleans())
        return kind, lambda: Store.open(path, cfg, read_only=ro).close()
    if kind == "create":
        arg = _Args(data, ["name", "num_layers", "num_kv_heads", "head_dim", "dtype", "device",
                           "fingerprint"])
        name = arg("name", st.sampled_from(["b", "c", "d.1", "E_2"]), names)
        shape = {k: arg(k, st.integers(1, 3), bad_ints)
                 for k in ("num_layers", "num_kv_heads", "head_dim")}
        dtype = arg("dtype", st.sampled_from(["float32", torch.float16]), dtypes)
        device = arg("device", st.sampled_from(["cpu", None, torch.device("cpu")]), devices)
        fp = arg("fingerprint", st.one_of(st.none(), st.text(max_size=3)), st.integers())

        def create() -> None:
            s = store.create(name, **shape, dtype=dtype, device=device, fingerprint=fp)
            assert NAME.fullmatch(s.name) and s.device.type == "cpu", s  # accepted invalid?
        return kind, create
    arg = _Args(data, ["name", "layer", "tensor", "other"])
    pick = arg("name", st.sampled_from(live or ["a"]), names)
    if kind == "drop":
        return kind, lambda: store.drop(pick)
    seq = store._seqs.get(pick)
    if seq is None:
        return kind, lambda: store.sequence(pick)
    H, D, dt = seq.num_kv_heads, seq.head_dim, seq.dtype
    layer = arg("layer", st.integers(0, seq.num_layers - 1), bad_ints)
    good = arg.bad != "tensor"
    if kind == "place":
        devs = arg("other", st.just(["cpu"] * seq.num_layers),
                   st.lists(devices, min_size=0, max_size=3))
        return kind, lambda: seq.place(devs)
    if kind in ("append", "transaction"):
        n = data.draw(st.integers(1, 40))
        k = data.draw(tensors((H, n, D), dt, good))
        v = data.draw(tensors((H, n, D), dt, good or data.draw(st.booleans())))
        drop_too = data.draw(st.booleans())

        def append() -> None:
            if kind == "transaction":
                with store.transaction():
                    seq.append(layer, k, v)
                    if drop_too:
                        store.drop(seq.name)
                    raise KeyError("the block fails: all undone")
            seq.append(layer, k, v)
            assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())
        return kind, append
    q = data.draw(tensors((2 * H, data.draw(st.integers(1, 3)), D), dt, good))
    scale = arg("other", st.none(), values) if kind == "query" else None
    if kind == "query":
        return kind, lambda: seq.query(layer, q, scale=scale)
    k = arg("other", st.integers(1, 3), bad_ints)
    return kind, lambda: seq.search(layer, q, k)


OUTCOMES: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    total = sum(OUTCOMES.values())
    print(f"\nAPI fuzz: {total} calls; " + ", ".join(f"{k} {v}" for k, v in
                                                   sorted(OUTCOMES.items())))


@functools.cache
def _template() -> Path:
    root = Path(tempfile.mkdtemp(prefix="vecstore-fuzz-")) / "s"
    atexit.register(shutil.rmtree, root.parent, True)
    with Store.open(root, config()) as store:
        seq = store.create("a", num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
        for layer in range(2):
            seq.append(layer, torch.randn(2, 50, 4), torch.randn(2, 50, 4))
    return root


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_call_succeeds_or_raises_a_vecstore_error_changing_nothing(data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "s"
        shutil.copytree(_template(), root)
        with Store.open(root) as store:
            for _ in range(data.draw(st.integers(1, 5))):
                before = _state(store, root)
                kind, call = _op(data, store, root)
                try:
                    call()
                except VecstoreError as exc:
                    outcome = "typed"
                    assert _state(store, root) == before, (kind, exc)
                except KeyError:
                    outcome = "rolled back"
                    assert _state(store, root) == before, kind
                else:
                    outcome = "ok"
                OUTCOMES[outcome] += 1
                event(f"{kind}: {outcome}")
            assert store.verify().ok
