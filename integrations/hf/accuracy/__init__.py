"""The accuracy harness: RULER-style tasks and attention fidelity on SmolLM2.

``python benchmarks/accuracy.py`` (or ``vecstore bench accuracy``) runs :func:`main`;
``--help`` lists the settings. Results go to ``benchmarks/results/accuracy.{json,md,png}``.
"""

from integrations.hf.accuracy.cli import main as main

__all__ = ["main"]
