"""torchtitan custom import for the peer curve (docs/PEER_CURVE.md): this recipe's sample order.

    PYTHONPATH=<repo>/tools:<repo>/.peers:$PYTHONPATH torchrun ... -m torchtitan.train \
        --experimental.custom_import tt_peercurve --model.name llama3_same_order --model.flavor 1B ...

Imported by torchtitan's trainer (v0.2.2: `Trainer.__init__` imports the custom module before
it looks up the train spec), this module

- imports the peers bundle's `tt_ext` (.peers/tt_ext.py: the Llama 3.2 1B shape as flavor
  "1B", untied, and the run-wide peak memory printed at exit), and
- registers the train spec `llama3_same_order`: torchtitan's own `llama3` spec with one part
  replaced, the data loader. Model, parallelism, mixed precision, optimizer, schedule,
  clipping, loss and the Hugging Face checkpoint load stay torchtitan's.

Why: both trainers pack the same way (every document as [BOS] + tokens + [EOS], in file
order, cut into samples of seq_len + 1 tokens), but they deal the samples out differently.
torchtitan's own text loader splits the *documents* between
the data-parallel ranks (rank r packs the r-th contiguous share of the file on its own) and
carries the unfinished sample across the end of the file into the next pass. This recipe
(data/loader.py, `data.shuffle=false`) packs the whole file into one stream, drops the tail
shorter than a sample, and gives global batch t the samples [t*G, (t+1)*G) of it, rank r the
rows [r*G/dp, (r+1)*G/dp) of those, the next pass starting again at sample 0. The loader here
hands each torchtitan rank exactly those rows, in that order (micro batches: consecutive
`training.local_batch_size` rows of the rank's share, as train.py splits them), so both
trainers see the same batch at every step.

`TT_PEERCURVE_SHIFT=0.5` starts the same order half a pass later: other batches at every
step, for a second torchtitan run whose distance from the first measures the spread of the
reference.

It reads the documents the way torchtitan's loader does (`training.dataset`,
`training.dataset_path`: a map-style dataset such as c4_test) and tokenizes with torchtitan's
tokenizer (`tokenizer.encode(text, add_bos=True, add_eos=True)`).

Imported anywhere else (tests import `tools.tt_peercurve`), it registers nothing: the sample
order (`rank_sample_ids`), the packing (`pack_documents`) and the dataset class are plain code.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

#: The train spec this module registers inside torchtitan.
SPEC_NAME = "llama3_same_order"
#: Environment variable: start the order this share of a pass later (0.5: half a pass), for a
#: second torchtitan run on other batches (the spread of the reference; docs/PEER_CURVE.md).
SHIFT_ENV = "TT_PEERCURVE_SHIFT"


def rank_sample_ids(
    start: int,
    count: int,
    *,
    rank: int,
    dp: int,
    global_batch: int,
    n_samples: int,
    shift: int = 0,
) -> np.ndarray:
    """Indices into the packed samples of data-parallel rank `rank`'s samples number start ..
    start + count - 1 (counted from the run's first step): global batch t holds positions
    [t*G, (t+1)*G), the rank the L = G/dp positions from t*G + rank*L, and position p is
    sample (p + shift) mod n_samples (sequential order, every pass the same; shift 0 is this
    recipe's order, another shift the same order begun elsewhere)."""
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp {dp}")
    local = global_batch // dp
    k = np.arange(start, start + count, dtype=np.int64)
    batch, row = np.divmod(k, local)
    return (batch * global_batch + rank * local + row + shift) % n_samples


def pack_documents(documents: Iterable[list[int]], seq_len: int) -> np.ndarray:
    """The documents' ids (each already [BOS] + tokens + [EOS]) concatenated and cut into
    samples of seq_len + 1 tokens: an (n, seq_len + 1) int64 array, the tail dropped."""
    stream = np.fromiter((t for doc in documents for t in doc), dtype=np.int64)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


class SameOrderDataset(IterableDataset, Stateful):
    """One data-parallel rank's samples of `samples` ((n, seq_len + 1) ids) in this recipe's
    order, endlessly; each item is torchtitan's ({"input": ids[:-1]}, ids[1:]). Its state is
    the number of samples it has handed out."""

    def __init__(
        self, samples: np.ndarray, *, rank: int, dp: int, global_batch: int, shift: int = 0
    ):
        if len(samples) < global_batch:
            raise ValueError(
                f"the data packs into {len(samples)} samples, fewer than one global batch "
                f"of {global_batch}"
            )
        self.samples = samples
        self.rank, self.dp, self.global_batch, self.shift = rank, dp, global_batch, shift
        self.taken = 0

    def __iter__(self) -> Iterator[tuple[dict, torch.Tensor]]:
        while True:
            (i,) = rank_sample_ids(
                self.taken,
                1,
                rank=self.rank,
                dp=self.dp,
                global_batch=self.global_batch,
                n_samples=len(self.samples),
                shift=self.shift,
            )
            self.taken += 1
            ids = torch.from_numpy(np.ascontiguousarray(self.samples[i]))
            yield {"input": ids[:-1]}, ids[1:]

    def state_dict(self) -> dict:
        return {"taken": self.taken}

    def load_state_dict(self, state_dict: dict) -> None:
        self.taken = int(state_dict["taken"])


def build_same_order_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    """torchtitan's `build_dataloader_fn` for SPEC_NAME (same arguments as its
    build_text_dataloader; the order never ends, like its infinite loader)."""
    import datasets
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets.text_datasets import _validate_dataset
    from torchtitan.tools.logging import logger

    training = job_config.training
    path, load, text_of = _validate_dataset(training.dataset.lower(), training.dataset_path)
    docs = load(path)
    if not isinstance(docs, datasets.Dataset):
        raise ValueError(
            f"{SPEC_NAME}: training.dataset {training.dataset} is streamed; the same order "
            "needs a map-style dataset such as c4_test"
        )
    samples = pack_documents(
        (tokenizer.encode(text_of(d), add_bos=True, add_eos=True) for d in docs), training.seq_len
    )
    global_batch = training.global_batch_size
    if global_batch < 0:
        global_batch = training.local_batch_size * dp_world_size
    shift = round(float(os.environ.get(SHIFT_ENV, "0")) * len(samples))
    logger.info(
        f"{SPEC_NAME}: {len(docs)} documents, {len(samples)} samples of {training.seq_len + 1} "
        f"tokens a pass, starting at sample {shift}; dp rank {dp_rank} of {dp_world_size} takes "
        f"rows {dp_rank * global_batch // dp_world_size}.. of each global batch of {global_batch}"
    )
    dataset = SameOrderDataset(
        samples, rank=dp_rank, dp=dp_world_size, global_batch=global_batch, shift=shift
    )
    kwargs = {**dataclasses.asdict(training.dataloader), "batch_size": training.local_batch_size}
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


def register() -> None:
    """tt_ext's 1B flavor, and SPEC_NAME: torchtitan's llama3 spec with this loader."""
    import tt_ext  # noqa: F401  # the peers bundle's: flavor "1B", peak memory at exit
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    spec = get_train_spec("llama3")
    register_train_spec(
        SPEC_NAME, dataclasses.replace(spec, build_dataloader_fn=build_same_order_dataloader)
    )


# Inside torchtitan's trainer (its train-spec registry is loaded): register. Anywhere else
# (the tests), nothing happens on import.
if "torchtitan.protocols.train_spec" in sys.modules:
    register()
