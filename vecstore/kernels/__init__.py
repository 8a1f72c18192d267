"""The decode kernels of the wave index and wave buffer: Triton kernels and their launches.

One query token per sequence, ``B`` sequences at once, grouped-query attention; rows are
``b * Hkv + h``. The wave executor (:mod:`vecstore.executor.wave_step`) runs them in this
order:

- :mod:`~vecstore.kernels.centroid_logits` — every cluster's centroid logits (index probe);
- :mod:`~vecstore.kernels.zone_select` — the clusters' ranking score and the retrieval and
  estimation zones (:mod:`~vecstore.kernels.radix_select`, :mod:`~vecstore.kernels.zone_write`,
  written into :class:`~vecstore.kernels.zones.Zones`);
- :mod:`~vecstore.kernels.retrieved_attention`, :mod:`~vecstore.kernels.steady_attention`,
  :mod:`~vecstore.kernels.estimated_attention` — split-K attention over the three zones;
- :mod:`~vecstore.kernels.merge_parts` — the log-sum-exp merge of their partial states;
- :mod:`~vecstore.kernels.slot_table`, :mod:`~vecstore.kernels.cluster_copy` — the wave
  buffer's slot lookup, admission and cluster copies (offloaded views);
- :mod:`~vecstore.kernels.step_stats` — a captured step's stats and NaN/Inf check, in one
  launch per layer.

:mod:`~vecstore.kernels.reference` is their torch reference; :mod:`~vecstore.kernels.backend`
chooses between the two. Importing this package does not import Triton (the kernel modules
do: ``triton`` is an optional dependency).
"""
