"""``python -m benchmarks.accuracy``: accuracy of vecstore's methods on
SmolLM2-135M-Instruct, RULER-style tasks and attention fidelity. ``--help`` lists the
settings; results go to ``benchmarks/results/accuracy.{json,md,png}``."""

import sys

from benchmarks.accuracy.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
