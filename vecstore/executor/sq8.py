"""Scalar quantization of centroids to int8 (SQ8), for the wave step's index probe.

Each vector is stored as int8 codes and one float32 scale, ``x ~ codes * scale`` with
``scale = max|x| / 127``: half the bytes of bfloat16 for the bandwidth-bound centroid scan.
Codes convert exactly to bfloat16 (8 significant bits), so the logits kernel scores
``(q . codes) * scale`` with the same tensor-core dot as bfloat16 centroids.

Examples
--------
>>> import torch
>>> codes, scale = quantize(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]))
>>> codes
tensor([[  64, -127,   32],
        [   0,    0,    0]], dtype=torch.int8)
>>> dequantize(codes, scale)[0]
tensor([ 0.5039, -1.0000,  0.2520])
"""

from __future__ import annotations

import torch

__all__ = ["quantize", "dequantize"]

_LEVELS = 127


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, ``x``'s shape) and per-vector scales (float32, ``x.shape[:-1]``) of the
    vectors along ``x``'s last dimension; an all-zero vector gets scale 0."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / _LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xf / safe[..., None]).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 vectors ``codes * scale`` that :func:`quantize`'s output stands for."""
    return codes.float() * scale[..., None]
