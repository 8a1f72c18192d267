"""A/B the wave decode step under variants of module-level launch constants, on one GPU.

Each variant is a name and settings ``module.ATTR=value`` (a Python literal) applied to
the imported modules for the time the variant is built and captured, or ``executor.NAME=value``
passed to its executor (:class:`ExecutorArgs`); kernels read these
constants when launched, so a CUDA graph captured under a variant keeps its launches.
Per size, every variant's step is captured in a CUDA graph, *replayed*, checked against
the torch reference executor (and its zones against the first variant's), then all are
timed interleaved with SDPA full attention as device time (`benchmarks.common.Timer`).

    python benchmarks/variants.py --sizes 8x131072 4x1048576 \\
        --variant base \\
        --variant kept4 vecstore.kernels.radix_select._KEPT=4 \\
        --variant bf16 executor.score_dtype="'bfloat16'"

Writes ``variants.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Setting = tuple[Any, str, Any]  # (module, attribute, value)


class ExecutorArgs:
    """The target of ``executor.NAME=value`` settings: keyword arguments of the variant's
    :class:`~vecstore.executor.wave_exec.WaveExecutor` (``score_dtype`` by torch dtype
    name, e.g. ``executor.score_dtype='bfloat16'``; unset: the executor's default)."""

    __name__ = "executor"
    score_dtype: str | None = None

    def kwargs(self) -> dict[str, Any]:
        dtype = self.score_dtype
        return {"score_dtype": getattr(torch, dtype)} if dtype else {}


EXECUTOR = ExecutorArgs()


def parse_setting(text: str) -> Setting:
    """``"pkg.module.ATTR=literal"`` -> ``(module, "ATTR", value)``; ``executor.ATTR``
    targets :data:`EXECUTOR`.

    Raises
    ------
    ValueError
        Malformed text, an unknown module or attribute, or a value that is not a literal.
    """
    target, sep, raw = text.partition("=")
    path, _, attr = target.strip().rpartition(".")
    if not sep or not path or not attr:
        raise ValueError(f"setting {text!r}: expected module.ATTR=value")
    module = EXECUTOR if path == "executor" else importlib.import_module(path)
    if not hasattr(module, attr):
        raise ValueError(f"setting {text!r}: {path} has no attribute {attr!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"setting {text!r}: {raw.strip()!r} is not a Python literal") from None
    return module, attr, value


def describe(settings: list[Setting]) -> str:
    """``settings`` as ``module.ATTR=value`` text, as a results table names them."""
    return " ".join(f"{m.__name__}.{a}={v!r}" for m, a, v in settings)


@contextmanager
def applied(settings: list[Setting]) -> Iterator[None]:
    """Apply ``settings`` for the block, then restore every attribute as it was."""
    saved = [(m, a, getattr(m, a)) for m, a, _ in settings]
    try:
        for module, attr, value in settings:
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def parse_size(text: str) -> tuple[int, int]:
    """``"8x131072"`` -> ``(8, 131072)`` (batch, context)."""
    batch, _, tokens = text.lower().partition("x")
    if not (batch.isdigit() and tokens.isdigit()):
        raise ValueError(f"size {text!r}: expected BATCHxCONTEXT, e.g. 8x131072")
    return int(batch), int(tokens)


def run_size(timer, batch: int, tokens: int, variants: list[tuple[str, list[Setting]]],
             reps: int) -> list[dict[str, Any]]:
    """Check and time every variant at one size; one row per variant."""
    import torch.nn.functional as F

    from benchmarks import decode_setup as dec
    from vecstore.executor.torch_ref import TorchExecutor
    from vecstore.executor.wave_exec import WaveExecutor
    from vecstore.index.wave import WaveIndex

    dev = torch.device("cuda")
    view, steady, q = dec.make_inputs(batch, tokens, dev, seed=batch * 7 + tokens % 97)
    index = WaveIndex(dec.CFG)
    q4, qs = q[:, :, None], q.contiguous()
    ref = TorchExecutor(dev.type).run(index, view, steady, q4, dec.SCALE, dec.LAYER)
    fns, checks, keep = {}, {}, []
    for name, settings in variants:
        with applied(settings):
            ex = WaveExecutor(dev.type, **EXECUTOR.kwargs())
            prep = ex.prepare(view, dec.LAYER, index)
            graph, res = dec.capture(lambda ex=ex, prep=prep: ex.decode(prep, steady, qs,
                                                                        dec.SCALE))
        graph.replay()  # a captured graph's outputs hold nothing until it is replayed
        torch.cuda.synchronize()
        first = keep[0][1] if keep else res
        checks[name] = {"err": dec.rel_err(res.out, ref[0][:, :, 0]),
                        "same_zones": bool(torch.equal(res.zones.zone, first.zones.zone))}
        keep.append((graph, res, ex, prep))
        fns[name] = graph.replay
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(q4, view.keys, view.values,
                                                         enable_gqa=True)
    t = timer.times(fns, reps=reps, device_only=tuple(fns))
    return [{"batch": batch, "context": tokens, "variant": name, "ms": t[name],
             "speedup": t["sdpa"] / t[name], "sdpa_ms": t["sdpa"], **checks[name],
             "settings": describe(settings)}
            for name, settings in variants]


def main() -> None:
    from benchmarks.common import RESULTS, Timer, machine, print_row, write_results

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8x131072", "8x524288", "4x1048576"])
    parser.add_argument("--variant", nargs="+", action="append", required=True,
                        metavar=("NAME", "MODULE.ATTR=VALUE"),
                        help="a name, then its settings (none: the code as it is)")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    try:
        variants = [(v[0], [parse_setting(s) for s in v[1:]]) for v in args.variant]
        sizes = [parse_size(size) for size in args.sizes]
    except ValueError as exc:
        parser.error(str(exc))
    timer = Timer(torch.device("cuda"))
    rows = []
    for batch, tokens in sizes:
        rows += run_size(timer, batch, tokens, variants, args.reps)
        torch.cuda.empty_cache()
        for r in rows[-len(variants):]:
            print_row(r)
    write_results(args.out, "variants", machine(), rows,
                  ["batch", "context", "variant", "ms", "speedup", "sdpa_ms", "err",
                   "same_zones", "settings"], "Wave decode step under variants")


if __name__ == "__main__":
    main()
