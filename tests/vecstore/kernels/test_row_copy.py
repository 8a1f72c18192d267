"""copy_rows: every head's rows, whatever lies between heads, and host rows registered with
CUDA in several ranges."""

from __future__ import annotations

import mmap

import pytest
import torch

from tests.interpreter import interpreted
from vecstore.kernels.row_copy import copy_rows


def _apart(x: torch.Tensor, room: int) -> torch.Tensor:
    # x laid out with ``room`` unused (NaN) rows after each head's, as a tier's reserve holds it
    heads, n, dim = x.shape
    reserve = torch.full((heads, n + room, dim), float("nan"), dtype=x.dtype, device=x.device)
    reserve[:, :n] = x
    return reserve[:, :n]


@pytest.mark.parametrize(("heads", "n", "dim", "dtype"), [
    (3, 70, 16, torch.float32), (2, 1, 24, torch.bfloat16), (1, 33, 128, torch.float16),
    (2, 0, 8, torch.float32)])
@interpreted
def test_copy_rows_copies_every_head_bit_exactly(gen, heads, n, dim, dtype):
    src = _apart(torch.randn(heads, n, dim, generator=gen).to(dtype), 5)
    dst = _apart(torch.zeros(heads, n, dim, dtype=dtype), 3)
    copy_rows(src, dst)
    assert torch.equal(dst, src)
    assert dst.untyped_storage().nbytes() > dst.numel() * dst.element_size()  # room kept


@pytest.mark.gpu
def test_gpu_copy_rows_reads_host_rows_registered_in_several_ranges(gen):
    from vecstore.kvstore.host_pages import HostPages

    heads, n, dim = 8, 5000, 128
    page_rows = mmap.PAGESIZE // (dim * 2)
    cap = 4 * n // page_rows * page_rows
    pages, memory = HostPages.map(heads * cap * dim * 2, register=True)
    host = memory.view(torch.bfloat16).view(heads, cap, dim)
    for h in range(heads):  # every head's rows in three registrations, as a tier grows them
        for lo, hi in ((0, 1024), (1024, 3072), (3072, 5008)):
            pages.pin((h * cap + lo) * dim * 2, (hi - lo) * dim * 2)
    src = host[:, :n]
    src.copy_(torch.randn(heads, n, dim, generator=gen).to(torch.bfloat16))
    dst = torch.empty(heads, n + 7, dim, dtype=torch.bfloat16, device="cuda")[:, :n]
    copy_rows(src, dst)
    assert torch.equal(dst.cpu(), src)
