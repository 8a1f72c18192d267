"""vecstore for Hugging Face transformers 5.x.

Usage, for a loaded Llama-family ``model`` and its ``input_ids``::

    from integrations.hf import WaveCache
    out = model.generate(input_ids, past_key_values=WaveCache(None, model))

- :class:`WaveCache`: a ``transformers.Cache`` backed by a vecstore store; creating one
  switches the model to vecstore's attention until it is closed.
- :func:`install`: registers the ``"vecstore"`` attention and mask functions (and
  optionally switches a model), undone on exit.
- :func:`load_smollm2`: the real model used by the demo and the accuracy harness.

Importing this package registers nothing.
"""

from integrations.hf.attention_fn import StepMask as StepMask
from integrations.hf.cache import WaveCache as WaveCache
from integrations.hf.cache import WaveCacheLayer as WaveCacheLayer
from integrations.hf.install import ATTENTION_NAME as ATTENTION_NAME
from integrations.hf.install import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES
from integrations.hf.install import ModelShape as ModelShape
from integrations.hf.install import install as install
from integrations.hf.install import model_fingerprint as model_fingerprint
from integrations.hf.install import model_shape as model_shape
from integrations.hf.model_loading import load_smollm2 as load_smollm2

__all__ = ["WaveCache", "WaveCacheLayer", "StepMask", "install", "model_shape",
           "model_fingerprint", "ModelShape", "ATTENTION_NAME", "SUPPORTED_MODEL_TYPES",
           "load_smollm2"]
