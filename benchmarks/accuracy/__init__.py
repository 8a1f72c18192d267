"""The accuracy harness: RULER-style tasks and attention fidelity on SmolLM2.

``python -m benchmarks.accuracy`` (or ``vecstore bench accuracy``, from a source checkout)
runs :func:`main`; ``--help`` lists the settings. Results go to
``benchmarks/results/accuracy.{json,md,png}``. The tasks live in :mod:`integrations.tasks`
(the demo's too).
"""

from benchmarks.accuracy.cli import main as main

__all__ = ["main"]
