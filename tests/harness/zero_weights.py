"""train.py whose model starts with every weight exactly 0: a dead model in any arithmetic.
Its hidden states are 0, so every gradient is exactly 0 and the loss stays ln(vocabulary),
step after step: what issue 55's run at lr 1e3 became after its blow-up on one CPU's kernels
(on others that run turns to NaN instead), here without depending on the CPU.

    python tests/harness/zero_weights.py <train.py overrides>

train.py runs in this process as __main__ (runpy), as slurm/run_trainer.py runs it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
sys.path[0] = str(TRAIN.parent)  # as if train.py had been started itself

import torch  # noqa: E402

import model  # noqa: E402


def main() -> None:
    init_weights = model.init_weights

    def zero_weights(module, *args, **kwargs):
        out = init_weights(module, *args, **kwargs)
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        return out

    model.init_weights = zero_weights  # train.py imports it from model when it runs
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
