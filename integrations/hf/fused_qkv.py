"""One GEMM for a layer's query, key and value projections, in a model left as it is.

A decode step reads every weight once for a few tokens: its projections are
bandwidth-bound GEMMs, and three small ones reach less of the bandwidth than one of their
sum (H200, Llama-3-8B's shapes at batch 8: 35 us as three, 22 us as one;
``benchmarks/results/projections.md``). Serving engines store the three as one matrix.
:func:`fuse_qkv` does so in a transformers model without touching its attention code:
the three weights are copied into one matrix and the parameters become views of it (the
same parameter objects: the state dict keeps its keys and shapes, the memory stays the
same), ``q_proj`` runs the one GEMM and leaves
the key and value columns for ``k_proj`` and ``v_proj``, which hand them over when called
with the same hidden states, as the attention modules call them (and otherwise compute
their own). Outputs are those of the separate projections, up to the GEMM's summation
order. It is for inference: where autograd records for weights that require gradients,
the three GEMMs run apart, so training is unchanged.

Fuse after the model is on its device and in its dtype: moving it afterwards gives the
projections new weights apart from the fused matrix, and the fused GEMM then fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from integrations.hf.capabilities import attention_modules

__all__ = ["fuse_qkv", "FusedQuery", "FusedPart"]


class _Columns:
    """The fused matrix of one attention module and the key and value columns its query
    projection computed last (with the hidden states they came from)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 sizes: list[int]) -> None:
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class _Projection(torch.nn.Module):
    # holds the linear layer's own parameters (their data views of the fused matrix now),
    # so whatever refers to them (an optimizer, hooks, tied weights) still does
    def __init__(self, linear: torch.nn.Linear, columns: _Columns) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.columns = columns

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fused")


class FusedQuery(_Projection):
    """``q_proj`` of a fused module: the query, key and value projections in one GEMM; returns
    the queries and keeps the keys and values for :class:`FusedPart`. Where autograd
    records (gradients enabled for weights that require them), each projection runs its
    own GEMM, so the gradients reach the three parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = self.columns
        if torch.is_grad_enabled() and self.weight.requires_grad:
            # the fused matrix is not the parameters' graph leaf: gradients must reach
            # the three parameters, so each runs its own GEMM
            cols.pending = None
            return F.linear(x, self.weight, self.bias)
        q, k, v = F.linear(x, cols.weight, cols.bias).split(cols.sizes, -1)
        cols.pending = (x, k, v)
        return q


class FusedPart(_Projection):
    """``k_proj`` (``part`` 1) or ``v_proj`` (2) of a fused module: the columns the query
    projection computed from the same hidden states, else its own GEMM."""

    def __init__(self, linear: torch.nn.Linear, columns: _Columns, part: int) -> None:
        super().__init__(linear, columns)
        self.part = part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = self.columns
        pending = cols.pending
        if pending is not None and pending[0] is x:
            if self.part == 2:
                cols.pending = None  # the last of the three: hold nothing past the layer
            return pending[self.part]
        return F.linear(x, self.weight, self.bias)


def fuse_qkv(model: torch.nn.Module) -> int:
    """Run each attention module's ``q_proj``, ``k_proj`` and ``v_proj`` as one GEMM.

    Modules whose three projections are not plain ``nn.Linear`` layers of one input size,
    dtype and device, all with or all without a bias, are left as they are; so are modules
    fused already and weights on the ``meta`` device (offloaded by accelerate, loaded at
    each forward). Returns the number of modules fused.

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    ...     num_key_value_heads=1)).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> with torch.no_grad():
    ...     before = model(ids).logits
    ...     fused = fuse_qkv(model), fuse_qkv(model)
    ...     after = model(ids).logits
    >>> fused, torch.allclose(after, before, atol=1e-6)
    ((2, 0), True)
    """
    fused = 0
    for attn in attention_modules(model):
        parts = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if not _fusable(parts):
            continue
        with torch.no_grad():
            weight = torch.cat([p.weight for p in parts])
            bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
            sizes = [p.out_features for p in parts]
            for p, w in zip(parts, weight.split(sizes), strict=True):
                p.weight.data = w
            if bias is not None:
                for p, b in zip(parts, bias.split(sizes), strict=True):
                    p.bias.data = b
        cols = _Columns(weight, bias, sizes)
        attn.q_proj = FusedQuery(parts[0], cols)
        attn.k_proj = FusedPart(parts[1], cols, 1)
        attn.v_proj = FusedPart(parts[2], cols, 2)
        fused += 1
    return fused


def _fusable(parts: list) -> bool:
    if not all(type(p) is torch.nn.Linear for p in parts):
        return False
    w = [p.weight for p in parts]
    return (len({(x.shape[1], x.dtype, x.device) for x in w}) == 1
            and w[0].device.type != "meta"  # offloaded (accelerate): loaded per forward
            and len({p.bias is None for p in parts}) == 1)
