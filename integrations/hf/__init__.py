"""vecstore for Hugging Face transformers 5.x.

Usage, for a loaded decoder ``model`` and its ``input_ids``::

    from integrations.hf import WaveCache
    out = model.generate(input_ids, cache=WaveCache(None, model))

(``past_key_values=`` before transformers 5.24; :func:`cache_arg` picks the name.)

- :class:`WaveCache`: a ``transformers.Cache`` backed by a vecstore store; creating one
  switches the model to vecstore's attention until it is closed.
- :func:`model_shape`: the capability checks a model must pass (no architecture list).
- :func:`install`: registers the ``"vecstore"`` attention and mask functions (and
  optionally switches a model), undone on exit.
- :func:`load_smollm2`: the real model used by the demo and the accuracy harness.

Importing this package registers nothing.
"""

from integrations.hf.attention_fn import StepMask as StepMask
from integrations.hf.cache import WaveCache as WaveCache
from integrations.hf.cache_arg import cache_arg as cache_arg
from integrations.hf.cache_arg import cache_kwarg as cache_kwarg
from integrations.hf.cache_layer import WaveCacheLayer as WaveCacheLayer
from integrations.hf.capabilities import TESTED_MODEL_TYPES as TESTED_MODEL_TYPES
from integrations.hf.capabilities import ModelShape as ModelShape
from integrations.hf.capabilities import model_shape as model_shape
from integrations.hf.install import ATTENTION_NAME as ATTENTION_NAME
from integrations.hf.install import install as install
from integrations.hf.install import model_fingerprint as model_fingerprint
from integrations.hf.model_loading import load_smollm2 as load_smollm2
from integrations.hf.model_stats import ModelDecodeStats as ModelDecodeStats
from integrations.hf.window_cache import WindowLayer as WindowLayer

__all__ = ["WaveCache", "WaveCacheLayer", "WindowLayer", "StepMask", "install", "model_shape",
           "model_fingerprint", "ModelShape", "ModelDecodeStats", "ATTENTION_NAME",
           "TESTED_MODEL_TYPES", "cache_arg", "cache_kwarg", "load_smollm2"]
