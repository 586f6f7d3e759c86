import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import runtime  # noqa: E402
from tests.distributed import launch_forked  # noqa: E402

# The test process, its gloo ranks and the train.py it starts compute as a CPU run does
# (runtime.pin_cpu_arithmetic, before any kernel), so a loss computed here compares bit for
# bit with a run's.
runtime.pin_cpu_arithmetic(torch.device("cpu"))
# train.py runs started by runtime.launch (one process, or a torchrun job's ranks) are forked
# from the preloaded server (TEST_LAUNCH=subprocess: new interpreters, as a user starts them).
if os.environ.get("TEST_LAUNCH") != "subprocess":
    runtime.set_train_launcher(launch_forked)


def pytest_collection_modifyitems(config, items):
    """Tests listed in tests/slow_tests.txt (measured slow) are marked `slow` too, so
    `make test-fast` (-m "not slow") leaves them out."""
    from tests.slow_list import listed

    slow = listed()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _environment_kept():
    """Each test leaves the process environment as it found it. A run made in the test process
    sets variables as a run of its own would (train.run sets TORCH_NCCL_HIGH_PRIORITY); left
    behind, they made the later tests' train.py runs differ from the preloaded server's
    environment, so each started new interpreters instead of forking (tests/distributed.py)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
