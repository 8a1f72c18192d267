"""One fused decode step of the wave executor: the index probe, then the three zones merged.

A decode step (one query token per sequence, ``B`` sequences at once, no Python loop over
sequences or heads):

1. centroid logits, the GQA-summed softmax score of every cluster, and the retrieval and
   estimation zones by radix select, without sorting
   (:func:`~vecstore.kernels.centroid_logits.centroid_logits`,
   :func:`~vecstore.kernels.zone_select.select_ranked`);
2. split-K attention over the retrieved rows, and on a side stream the steady zone and the
   estimated clusters, merged by log-sum-exp (:mod:`vecstore.kernels.retrieved_attention`,
   :mod:`~vecstore.kernels.steady_attention`, :mod:`~vecstore.kernels.estimated_attention`,
   :mod:`~vecstore.kernels.merge_parts`).

KV rows that live in host memory go through the view's
:class:`~vecstore.buffer.WaveBuffer`: block cache, execution buffer, misses over PCIe.
The kernel modules are imported at the first step, not at import: ``triton`` is an optional
dependency.
"""

from __future__ import annotations

import torch

from vecstore.buffer.wave_buffer import WaveBuffer
from vecstore.executor.base import Steady
from vecstore.executor.wave_state import DecodeResult, PreparedView
from vecstore.executor.wave_streams import StreamPool, on, pipeline_groups
from vecstore.kernels.zones import Zones

__all__ = ["decode_step", "attend_offloaded"]


def decode_step(prep: PreparedView, steady: Steady, q: torch.Tensor, scale: float,
                streams: StreamPool, softcap: float | None = None,
                steady_ready: torch.cuda.Event | None = None) -> DecodeResult:
    """One decode step: ``q [B, Hq, D]`` against the view and the steady zone, every zone's
    scores soft-capped by ``softcap`` (``None``: no cap; the ranking stays uncapped, see
    :meth:`~vecstore.executor.base.Executor.run`). ``steady_ready``: an event recorded once
    the steady zone's rows were written on another stream; only the steady zone's attention
    waits for it.

    Only device work of fixed shapes for fixed inputs (the steady capacity included), so the
    whole call can be captured in a CUDA graph; an offloaded view's
    :meth:`WaveBuffer.begin_step`/`finish_step` run outside it. A graph capturing it reads
    ``prep``'s tensors: keep ``prep`` alive as long as the graph.

    On CUDA the rows are served in :func:`~vecstore.executor.wave_streams.pipeline_groups`
    groups: the current stream computes every group's centroid logits one after the other
    (bandwidth-bound), and each group's selection (latency-bound) and attention run on a
    stream of their own from ``streams`` as soon as its logits are written, next to the
    following groups' logits. In a group, a side stream attends the estimated zone next to
    the retrieved one (they read different bytes); the first group's side stream also
    attends the steady zone next to its selection.
    """
    from vecstore.kernels.centroid_logits import centroid_logits
    from vecstore.kernels.estimated_attention import attend_estimated, estimate_layout
    from vecstore.kernels.merge_parts import combine
    from vecstore.kernels.retrieved_attention import (
        attend_retrieved,
        fill_rowmap,
        retrieved_layout,
    )
    from vecstore.kernels.steady_attention import attend_steady, steady_splits
    from vecstore.kernels.zone_select import select_ranked

    B, Hq, D = q.shape
    rows, C = prep.sizes.shape
    G = B * Hq // rows
    dev = q.device
    buf = prep.buffer
    _, n_ret = retrieved_layout(prep.max_rows)
    main = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    if buf is not None:
        n_ret *= 2  # the hits and the misses of the execution buffer apart
    n_std = steady_splits(steady.keys.shape[2])
    _, n_est = estimate_layout(prep.e_max)
    P = n_ret + n_std + n_est
    parts = (torch.empty(B * Hq, P, D, dtype=torch.float32, device=dev),
             torch.empty(B * Hq, P, dtype=torch.float32, device=dev))
    qf = q.reshape(B * Hq, D).contiguous()
    qs = qf if prep.code_scales is not None else qf.to(prep.centroids.dtype)
    cent = prep.centroids.view(rows, C, D)
    weights = torch.empty(B * Hq, C, dtype=torch.float32, device=dev)
    zones = Zones.empty(rows, C, prep.r_max, dev, prep.e_max)
    out = torch.empty(B * Hq, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B * Hq, dtype=torch.float32, device=dev)
    groups = 1 if buf is not None else pipeline_groups(rows, C)
    role = "sole" if groups == 1 and buf is None else "select"
    steady_done = torch.cuda.Event() if main is not None else None
    joins = []
    # every group's logits, allocated on the current stream and read on the group's own,
    # are held until that stream is joined: freed sooner, a later group's logits could be
    # written into them while the group's selection still reads them
    held = []
    for g in range(groups):
        r0, r1 = g * rows // groups, (g + 1) * rows // groups
        x0, x1 = r0 * G, r1 * G
        radii = prep.radii[r0:r1] if prep.radii is not None else None
        scales = prep.code_scales[r0:r1] if prep.code_scales is not None else None
        logits = centroid_logits(qs[x0:x1], cent[r0:r1], radii, prep.sizes[r0:r1], scale,
                                 prep.radius_weight, weights[x0:x1], scales, softcap)
        held.append(logits)
        sel, side = streams.get(dev, role, g), streams.get(dev, "side", g)
        if sel is not None:
            sel.wait_stream(main)  # this group's logits; the next group's follow on main
            joins.append(sel)
        part = (parts[0][x0:x1], parts[1][x0:x1])
        z = zones.rows(r0, r1)
        with on(sel):
            if g == 0:  # the steady zone's reads overlap the first group's selection
                if side is not None:
                    side.wait_stream(sel)
                with on(side):
                    if steady_ready is not None:
                        torch.cuda.current_stream(dev).wait_event(steady_ready)
                    attend_steady(qf, steady.keys, steady.values, steady.lengths, scale,
                                  parts, n_ret, softcap)
                    if steady_done is not None:
                        steady_done.record()
            select_ranked(logits, prep.sizes[r0:r1], prep.first_row[r0:r1],
                          prep.k1[r0:r1], prep.k2[r0:r1], z)
            if side is not None:
                side.wait_stream(sel)  # the estimated zone reads other bytes than retrieved
            with on(side):
                attend_estimated(weights[x0:x1], prep.vmean[r0:r1], z, part, n_ret + n_std)
            if buf is None:
                rowmap = torch.empty(r1 - r0, prep.max_rows, dtype=torch.int32, device=dev)
                fill_rowmap(z, rowmap)
                attend_retrieved(qf[x0:x1], prep.keys[r0:r1], prep.values[r0:r1], z, rowmap,
                                 scale, part, 0, softcap=softcap)
            else:
                admit = attend_offloaded(streams, buf, z, qf[x0:x1], scale, part, softcap)
                if admit is not None:
                    joins.append(admit)
            if sel is not None:
                sel.wait_stream(side)
                sel.wait_event(steady_done)
            combine(part, out[x0:x1], lse[x0:x1])
    for stream in joins:
        main.wait_stream(stream)
    return DecodeResult(out=out.view(B, Hq, D), lse=lse.view(B, Hq), zones=zones,
                        parts_lse=parts[1], num_exact_parts=n_ret + n_std)


def attend_offloaded(streams: StreamPool, buf: WaveBuffer, zones: Zones, q: torch.Tensor,
                     scale: float, parts: tuple[torch.Tensor, torch.Tensor],
                     softcap: float | None = None) -> torch.cuda.Stream | None:
    """The retrieved zone of an offloaded view, on the current stream: the block cache's
    lookup, the misses copied into the execution buffer, attention over the hits (read in
    their cache slots) while the misses cross PCIe, then over the misses. The admission
    runs on a stream of its own: its bookkeeping (it reads the lookup, and hits never lose
    their slots) while the misses are copied, its copy of the admitted rows into the cache
    after the attention over the misses, beside the merge (returned: the caller joins it).
    ``softcap`` soft-caps the scores (``None``: no cap)."""
    from vecstore.kernels.retrieved_attention import attend_retrieved, retrieved_layout

    current = torch.cuda.current_stream(q.device) if q.device.type == "cuda" else None
    admit = streams.get(q.device, "admit")
    buf.lookup(zones)
    if admit is not None:
        admit.wait_stream(current)
    with on(admit):
        buf.plan_admission()
    buf.fill_misses()
    buf.map_hits()
    split = buf.layout.split
    attend_retrieved(q, buf.cache_k, buf.cache_v, zones, buf.hit_map, scale, parts, 0,
                     split=split, softcap=softcap)
    buf.wait_misses()
    attend_retrieved(q, buf.exec_k, buf.exec_v, zones, None, scale, parts,
                     retrieved_layout(buf.exec_k.shape[1])[1], split=split,
                     after_split=True, softcap=softcap)
    if admit is not None:
        admit.wait_stream(current)  # the misses have arrived
    with on(admit):
        buf.admit()
    return admit
