"""Indexes: ``wave`` (the method) and the baselines ``flat``, ``quest``, ``sink_window``,
``topk_oracle``, all behind one :class:`Index` interface."""

from vecstore.index import flat as flat
from vecstore.index import quest as quest
from vecstore.index import sink_window as sink_window
from vecstore.index import topk_oracle as topk_oracle
from vecstore.index import wave as wave
from vecstore.index.base import INDEXES as INDEXES
from vecstore.index.base import EstimatingIndex as EstimatingIndex
from vecstore.index.base import Index as Index
from vecstore.index.base import IndexView as IndexView
from vecstore.index.base import Segment as Segment
from vecstore.index.base import UnitSummary as UnitSummary

__all__ = ["INDEXES", "EstimatingIndex", "Index", "IndexView", "Segment", "UnitSummary"]
