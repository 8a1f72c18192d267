"""Rows that branch off stored sequences: beam search, row selection, and cropping.

transformers' beam search reorders the cache's batch rows every step
(``reorder_cache(beam_idx)``), and assisted decoding removes the tokens the model did not
accept (``crop(-n)``). A store sequence is append-only and shared by nothing, so instead
the rows keep their recent tokens in :class:`Branches`:

- each row reads a *parent* stored sequence (the indexed prefix, shared by every beam
  that descends from it) through ``store.query``, and
- attends exactly to its own *tail*: the tokens of the steps since it branched, kept here
  per row (``[R, Hkv, t, D]`` per layer), never in the store.

The two partial results merge exactly by log-sum-exp, as a continued prefill does. A row
operation only reorders the tails and the parent list. In beam mode the tails grow for as
long as the generation runs; for cropping (``commit=True``) they hold the latest step
only and are appended to the store once a crop has settled them.
"""

from __future__ import annotations

import torch

from attention import DecodeStats
from attention.decode import ingest, query_store
from vecstore import Sequence, Store
from vecstore.errors import IncompatibleError
from vecstore.kernels.reference import attend, merge
from vecstore.slicing import query_slices
from vecstore.types import QueryStats

__all__ = ["Branches", "tail_attention", "crop_error"]


def crop_error(n: int, held: int) -> IncompatibleError:
    """The error of a crop reaching into tokens that are in the store already."""
    return IncompatibleError(
        f"cannot crop {n} tokens: the WaveCache keeps the last {held} outside the store, and "
        "stored tokens are not removed; crop only what the latest forward pass added, after "
        "activate_past_recording() (as assisted decoding does)")


def tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   valid: torch.Tensor | None, softcap: float | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the last ``L`` tokens' queries over ``k, v``, causal among those ``L``.

    Parameters
    ----------
    q : torch.Tensor
        ``[R, Hq, L, D]`` queries of the step's tokens, the last ``L`` of ``k``.
    k, v : torch.Tensor
        ``[R, Hkv, T, D]``, ``T >= L``: a row's tail, then the step's tokens.
    valid : torch.Tensor | None
        ``[R, T]`` bool, ``False`` for padding; ``None`` = all valid.
    softcap : float | None
        Attention logit soft-cap; ``None``: none.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out [R, Hq, L, D]`` and ``lse [R, Hq, L]``, float32; a query seeing no valid
        key has ``out = 0`` and ``lse = -inf``.

    Examples
    --------
    >>> q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    >>> out, lse = tail_attention(q, k, v, scale=0.5, valid=None)
    >>> ref = torch.softmax(0.5 * q @ k.transpose(2, 3), -1) @ v
    >>> torch.allclose(out, ref, atol=1e-6)
    True
    """
    R, Hq, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    pos = torch.arange(T, device=q.device)
    mask = (pos[None, :] <= pos[T - L:, None])[None, None, None]  # [1, 1, 1, L, T]
    if valid is not None:
        mask = mask & valid[:, None, None, None, :]
    qg = q.reshape(R, Hkv, Hq // Hkv, L, D)
    outs, lses = [], []
    for part in query_slices(L, T, rows=R * Hq):  # bounded [.., l, T] scores at a time
        out, lse = attend(qg[:, :, :, part], k, v, mask[:, :, :, part], scale, softcap)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=3).reshape(R, Hq, L, D), torch.cat(lses, dim=3).reshape(R, Hq, L)


class Branches:
    """Per-row tails over parent sequences, for every store layer of a cache.

    Parameters
    ----------
    num_layers : int
        Store layers.
    rows : int
        Batch rows; row ``r`` starts as a branch of sequence ``r`` with an empty tail.
    commit : bool
        Rows are their parents (no beams): :meth:`commit` appends the tails to them.
    """

    def __init__(self, num_layers: int, rows: int, *, commit: bool) -> None:
        self.parents = list(range(rows))
        self.commits = commit
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.valid: list[torch.Tensor | None] = [None] * num_layers  # [R, t] bool
        self.stats: list[QueryStats] = []  # decode steps' store stats, not yet folded
        self.folded = DecodeStats()  # those folded so far

    def tail_length(self, layer: int) -> int:
        keys = self.keys[layer]
        return 0 if keys is None else keys.shape[2]

    def attend(self, store: Store, seqs: list[Sequence], layer: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, *, valid: torch.Tensor | None,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        """One step of ``layer``: each row's parent through the store, its tail and the
        step's tokens exactly; the step's tokens then join the tails. ``softcap``
        soft-caps every logit (``None``: no cap).

        Returns ``[R, Hq, L, D]`` in ``q``'s dtype.
        """
        R, L = q.shape[0], q.shape[2]
        if R != len(self.parents):
            raise IncompatibleError(f"batch: the cache holds {len(self.parents)} rows, got a "
                                    f"step with {R}")
        rows = [seqs[p] for p in self.parents]
        out_p, lse_p, stats = query_store(store, rows, layer, q, scale, softcap=softcap)
        if stats is not None and L == 1:
            self.stats.append(stats)
        step_valid = valid if valid is not None else torch.ones(R, L, dtype=torch.bool,
                                                               device=q.device)
        old_k, old_v, old_valid = self.keys[layer], self.values[layer], self.valid[layer]
        if old_k is not None and old_v is not None and old_valid is not None:
            k = torch.cat([old_k, k], dim=2)
            v = torch.cat([old_v, v], dim=2)
            step_valid = torch.cat([old_valid, step_valid], dim=1)
        self.keys[layer], self.values[layer], self.valid[layer] = k, v, step_valid
        out_t, lse_t = tail_attention(q, k, v, scale=scale, valid=step_valid, softcap=softcap)
        out, _ = merge(out_p.float(), lse_p, out_t, lse_t)
        return out.to(q.dtype)

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` in that order (repeats allowed): beams reordered, rows
        repeated or dropped."""
        self.parents = [self.parents[i] for i in index.tolist()]
        self.commits = False
        for layer, keys in enumerate(self.keys):
            values, valid = self.values[layer], self.valid[layer]
            if keys is not None and values is not None and valid is not None:
                idx = index.to(keys.device)
                self.keys[layer] = keys.index_select(0, idx)
                self.values[layer] = values.index_select(0, idx)
                self.valid[layer] = valid.index_select(0, idx.to(valid.device))

    def crop(self, layer: int, n: int) -> None:
        """Forget the last ``n`` tokens of ``layer``'s tails."""
        held = self.tail_length(layer)
        if n > held:
            raise crop_error(n, held)
        keys, values, valid = self.keys[layer], self.values[layer], self.valid[layer]
        if n and keys is not None and values is not None and valid is not None:
            self.keys[layer] = keys[:, :, :held - n]
            self.values[layer] = values[:, :, :held - n]
            self.valid[layer] = valid[:, :held - n]

    def commit(self, store: Store, seqs: list[Sequence], layer: int) -> None:
        """Append ``layer``'s tails to the rows' own sequences (``commit=True`` only)."""
        keys, values, valid = self.keys[layer], self.values[layer], self.valid[layer]
        if not self.commits or keys is None or values is None or keys.shape[2] == 0:
            return
        assert valid is not None
        ingest(store, seqs, layer, keys, values, None if bool(valid.all()) else valid)
        self.keys[layer] = self.values[layer] = self.valid[layer] = None
