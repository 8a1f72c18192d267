"""Accuracy of vecstore's methods on SmolLM2-135M-Instruct: RULER-style tasks and
attention fidelity. ``python benchmarks/accuracy.py --help`` lists the settings; results
go to ``benchmarks/results/accuracy.{json,md,png}``."""

import sys

from integrations.hf.accuracy import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
