"""The engine: a store's sequences and layers, their transactions, batches, queries and
decode steps, built on the components below it (indexes, KV tiers, the catalog, storage,
executors). Users reach it through :mod:`vecstore` (``Store``, ``Sequence``).

Bottom up: a layer's parts (:mod:`~vecstore.engine.tail`, ``layer_image``, ``layer_mark``,
``layer_lineage``, ``layer_indexes``); :mod:`~vecstore.engine.layer_state`; sequences and
the tails they share (``sequence``, ``shared_tail``, ``lazy_layer``); batches, decoders,
transactions and the assembly of sequences from stored records (``batch``, ``decoder``,
``transaction``, ``sequence_builder``); :mod:`~vecstore.engine.query_engine`;
:mod:`~vecstore.engine.writer`; the store (``store_core`` < ``store_data`` < ``store``).
"""
