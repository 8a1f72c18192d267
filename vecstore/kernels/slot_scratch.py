"""The admission kernel's working memory, kept by a wave buffer across steps.

Plain torch (no Triton needed to import): :class:`vecstore.buffer.WaveBuffer` allocates it
with its other device tensors; :func:`vecstore.kernels.slot_table.plan_admission` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AdmissionScratch"]


@dataclass(frozen=True, slots=True)
class AdmissionScratch:
    """Working memory of :func:`~vecstore.kernels.slot_table.plan_admission` for ``rows``
    rows of ``S`` slots.

    Attributes
    ----------
    mark : torch.Tensor
        ``[rows, S]`` int8: the slots a step's hits hold (set and cleared by each launch:
        zero between launches).
    free : torch.Tensor
        ``[rows, S]`` int32: a step's usable slots in victim order.

    Examples
    --------
    >>> s = AdmissionScratch.empty(2, 3, torch.device("cpu"))
    >>> s.mark.shape, int(s.mark.sum())
    (torch.Size([2, 3]), 0)
    """

    mark: torch.Tensor
    free: torch.Tensor

    @staticmethod
    def empty(rows: int, num_slots: int, device: torch.device) -> AdmissionScratch:
        """Zeroed marks and an unset free list."""
        return AdmissionScratch(
            torch.zeros(rows, num_slots, dtype=torch.int8, device=device),
            torch.empty(rows, num_slots, dtype=torch.int32, device=device))
