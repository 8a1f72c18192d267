"""Clusterers: batched spherical k-means backends (``torch``, ``faiss``, ``cupy``)."""

from vecstore.cluster import cupy_kmeans as cupy_kmeans
from vecstore.cluster import faiss_kmeans as faiss_kmeans
from vecstore.cluster import torch_kmeans as torch_kmeans
from vecstore.cluster.base import CLUSTERERS as CLUSTERERS
from vecstore.cluster.base import Clusterer as Clusterer
from vecstore.cluster.base import strided_init as strided_init

__all__ = ["CLUSTERERS", "Clusterer", "strided_init"]
