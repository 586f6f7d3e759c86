"""Test harnesses: multi-run and multi-GPU checks too large for a pytest case, each with a
command line (run from the repository root, as modules so torchrun can start them too):

    python -m tests.harness.resume ...                          resume parity (the one harness)
    torchrun --nproc_per_node=4 -m tests.harness.matrix ...     recipe x layout x mode, resumed
    torchrun --nproc_per_node=4 -m tests.harness.parity ...     TE layouts vs one GPU
    python -m tests.harness.scale ROOT                          table of the suite's scale stage

tests/gpu/suite.sh runs them on a GPU machine; tests/test_harness.py and tests/gpu/ run them
from pytest. They use the library (train.py, runlog.py, ...) and nothing from tools/.
"""
