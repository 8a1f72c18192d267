"""QueryStats built on the device read back lazily and equal the eager ones."""

from __future__ import annotations

import pickle

import torch

from vecstore.types import QueryStats


def test_deferred_stats_equal_eager_ones_and_read_back_once():
    eager = QueryStats(tokens_total=1000, tokens_exact=37, units_retrieved=12,
                       units_estimated=90, estimated_mass=0.125)
    values = torch.tensor([1000, 37, 12, 90, 0.125], dtype=torch.float64)
    lazy = QueryStats.deferred(values)
    assert not lazy.is_materialized
    assert lazy.tokens_exact == 37 and isinstance(lazy.tokens_exact, int)
    assert lazy.is_materialized
    values.zero_()  # read back already: later reads see the values of the first
    assert lazy == eager and hash(lazy) == hash(eager) and repr(lazy) == repr(eager)
    assert lazy.exact_fraction == 0.037
    assert pickle.loads(pickle.dumps(lazy)) == eager


def test_materialize_reads_a_list_back_at_once():
    many = [QueryStats.deferred(torch.tensor([10.0 * i, i, 0, 0, 0.0], dtype=torch.float64))
            for i in range(5)] + [QueryStats(1, 1, 0, 0, 0.0)]
    QueryStats.materialize(many)
    assert all(s.is_materialized for s in many)
    assert [s.tokens_exact for s in many] == [0, 1, 2, 3, 4, 1]
