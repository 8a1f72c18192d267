"""How fast fresh host memory becomes pinned memory the GPU can read, by method.

The pinned tier registers anonymous mappings of its own with CUDA (``cudaHostRegister``,
:mod:`vecstore.kvstore.host_pages`). Registering untouched pages makes the kernel fault in
and zero every page inside the call, which is most of a pinned prefill's extra time; pages
already touched register far faster. Each method maps ``--gib`` GiB afresh and makes it
pinned, timing its two parts, in private anonymous memory (the tier's) and in shared
anonymous memory (``mmap``'s default, shmem):

- ``register``: one ``cudaHostRegister`` of the untouched mapping.
- ``populate``: the pages faulted in first by ``madvise(MADV_POPULATE_WRITE)`` from one
  thread (:func:`vecstore.kvstore.host_pages.fault_in`), then the registration.
- ``populate_tN``: the same from ``N`` threads, each faulting in a part (what
  :meth:`HostPages.pin` does, with ``_FAULT_THREADS`` threads).
- ``zero_tN``: the pages touched by ``torch.zero_`` with ``N`` intra-op threads, then the
  registration.

``launch_us`` is the mean wall time of a small kernel launched and waited for, one after
the other, from the main thread while the method's faulting runs on other threads (for
``register``, while the registration runs on another thread); ``idle_launch_us`` is the same
with nothing else running.

    python benchmarks/host_pages.py [--gib 4] [--threads 4 8 16] [--out DIR]

Writes ``host_pages.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine, print_row, write_results  # noqa: E402
from vecstore.kvstore import host_pages  # noqa: E402
from vecstore.kvstore.host_pages import HostPages  # noqa: E402


def _fault_threads(n: int) -> None:
    """Make :func:`host_pages.fault_in` use ``n`` threads (0: fault nothing ahead)."""
    if host_pages._fault_pool.cache_info().currsize:
        host_pages._fault_pool().shutdown()
        host_pages._fault_pool.cache_clear()
    host_pages._FAULT_THREADS = n


def _launch_us(stop: threading.Event | None, device: torch.device) -> float:
    """Mean µs of a tiny kernel launched and waited for (until ``stop`` is set, or 200)."""
    x = torch.zeros(16, device=device)
    n, t0 = 0, time.perf_counter()
    while (stop is None and n < 200) or (stop is not None and not stop.is_set()):
        x.add_(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        n += 1
    return (time.perf_counter() - t0) / max(n, 1) * 1e6


def run(method: str, mapping: str, num_bytes: int, device: torch.device) -> dict:
    """Map ``num_bytes`` afresh (``mapping``: private or shared anonymous memory) and pin it
    by ``method``; seconds of each part."""
    threads = int(method.rsplit("_t", 1)[1]) if "_t" in method else 1
    host_pages._MAP_FLAGS = mmap.MAP_PRIVATE if mapping == "private" else mmap.MAP_SHARED
    pages, memory = HostPages.map(num_bytes, register=torch.cuda.is_available())

    def fault(pages_memory: torch.Tensor) -> None:
        if method.startswith("populate"):
            _fault_threads(threads)
            if not host_pages.fault_in([(pages.base, num_bytes)]):
                raise OSError("madvise(MADV_POPULATE_WRITE) failed or is missing")
        elif method.startswith("zero"):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                pages_memory.zero_()
            finally:
                torch.set_num_threads(previous)

    stop, launch = threading.Event(), [0.0]
    probe = threading.Thread(target=lambda: launch.__setitem__(0, _launch_us(stop, device)))
    try:
        probe.start()
        t0 = time.perf_counter()
        fault(memory)
        t1 = time.perf_counter()
        _fault_threads(0)  # the registration alone
        if method == "register":
            pages.pin(0, num_bytes)
        stop.set()
        probe.join()
        if method != "register":
            t1 = time.perf_counter()
            pages.pin(0, num_bytes)
        t2 = time.perf_counter()
    finally:
        stop.set()
        probe.join()
        del memory  # unregistered and unmapped
    total = t2 - t0
    return {"method": method, "mapping": mapping, "gib": num_bytes / 2**30, "fault_s": t1 - t0,
            "register_s": t2 - t1, "total_s": total, "gbs": num_bytes / total / 1e9,
            "launch_us": launch[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--threads", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_bytes = int(args.gib * 2**30) // mmap.PAGESIZE * mmap.PAGESIZE
    _launch_us(None, device)  # warm-up
    idle = _launch_us(None, device)
    populate = ["populate", *(f"populate_t{n}" for n in args.threads)]
    if host_pages._madvise() is None:
        print("no madvise(MADV_POPULATE_WRITE) here: the populate methods are left out")
        populate = []
    methods = ["register", *populate, *(f"zero_t{n}" for n in args.threads)]
    rows = []
    for mapping in ("private", "shared"):
        for method in methods:
            row = run(method, mapping, num_bytes, device) | {"idle_launch_us": idle}
            print_row(row)
            rows.append(row)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    meta = machine() | {"thp": thp.read_text().strip() if thp.exists() else None,
                        "cpus": len(os.sched_getaffinity(0))}
    write_results(args.out, "host_pages", meta, rows,
                  ["method", "mapping", "gib", "fault_s", "register_s", "total_s", "gbs",
                   "launch_us", "idle_launch_us"],
                  "Fresh host memory made pinned, by method")


if __name__ == "__main__":
    main()
