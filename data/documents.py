"""Document boundaries of packed samples, for attention that stops at each document (data.document_mask).

A packed sample is a window of the token stream `[BOS] doc [EOS] [BOS] doc [EOS] ...`
(data/packing.py). The documents inside a window are recovered from its tokens alone: packing
puts BOS first and EOS last in every document, and neither tokenizer lets a document's text
produce them (the byte tokenizer's ids < 256 are bytes; HFTokenizer encodes with
`split_special_tokens=True`). So the boundaries need no storage of their own: the token cache,
the streaming path, the embedded corpus and the held-out batches all carry them in their
tokens, and a resumed or resharded run finds the same boundaries wherever it reads a sample.

The rule, on a row of inputs:
- a tokenizer with a BOS distinct from EOS: a document starts at every BOS;
- a tokenizer without BOS: a document starts after every EOS;
- a tokenizer whose BOS is its EOS (GPT-2 style, where packing writes [E] doc [E]): a document
  starts at an E that follows an E (the second of the pair). Exact unless a document is empty.
The first token of a row always starts a segment (a document cut by the window's start).

`Documents` holds what attention needs, in the two forms the implementations use:
`cu_seqlens` (TE's THD layout: cumulative segment lengths over the batch's B*S tokens,
row-major) and `positions` (each token's position in its document, which restarts RoPE and
gives the reference model its mask). Built on the CPU from the loader's rows, so the device
never has to be asked where the documents are (no host sync in the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime import to_device


def document_starts(inputs: np.ndarray, bos_id: int | None, eos_id: int) -> np.ndarray:
    """Boolean (B, S): True where a segment starts (see the module docstring's rule)."""
    inputs = np.asarray(inputs)
    starts = np.zeros(inputs.shape, dtype=bool)
    if bos_id is not None and bos_id != eos_id:
        starts[:] = inputs == bos_id
    elif bos_id is None:
        starts[:, 1:] = inputs[:, :-1] == eos_id
    else:
        starts[:, 1:] = (inputs[:, :-1] == eos_id) & (inputs[:, 1:] == bos_id)
    starts[:, 0] = True
    return starts


def positions_from_starts(starts: np.ndarray) -> np.ndarray:
    """int64 (B, S): each token's distance from the start of its segment."""
    idx = np.broadcast_to(np.arange(starts.shape[1], dtype=np.int64), starts.shape)
    last_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return idx - last_start


@dataclass
class Documents:
    """The segments of a (B, S) batch of inputs. `positions` (B, S) int64; `cu_seqlens`
    (segments + 1,) int32, offsets into the row-major flattened B*S tokens; `max_seqlen`, the
    longest segment (a Python int: TE sizes its kernels with it)."""

    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def from_positions(cls, positions: np.ndarray | torch.Tensor) -> Documents:
        pos = np.asarray(positions.cpu() if isinstance(positions, torch.Tensor) else positions)
        flat = pos.reshape(-1)
        bounds = np.append(np.flatnonzero(flat == 0), flat.size).astype(np.int32)
        return cls(
            positions=torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)),
            cu_seqlens=torch.from_numpy(bounds),
            max_seqlen=int(np.diff(bounds).max()),
        )

    @classmethod
    def from_inputs(cls, inputs: torch.Tensor, bos_id: int | None, eos_id: int) -> Documents:
        """From a CPU batch of inputs (B, S) and the tokenizer's BOS/EOS ids."""
        return cls.from_positions(positions_from_starts(document_starts(inputs, bos_id, eos_id)))

    @property
    def rows(self) -> int:
        return self.positions.shape[0]

    @property
    def segments(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def whole_rows(self) -> bool:
        """No boundary inside any row: per-row causal attention is already per-document."""
        return self.segments == self.rows

    def chunk(self, n: int) -> list[Documents]:
        """Split by rows as `Tensor.chunk(n)` splits the inputs (one part per micro batch)."""
        return [Documents.from_positions(p) for p in self.positions.chunk(n)]

    def to(self, device: torch.device | str) -> Documents:
        """On `device` (to a GPU without waiting for the queued kernels: runtime.to_device)."""
        return Documents(
            to_device(self.positions, device), to_device(self.cu_seqlens, device), self.max_seqlen
        )


class DocumentBoundaries:
    """The tokenizer's boundary rule as a callable: inputs (B, S) on the CPU -> their
    `Documents`. One per run, set on the loader by data.build_loader (`loader.boundaries`)."""

    def __init__(self, bos_id: int | None, eos_id: int):
        self.bos_id, self.eos_id = bos_id, eos_id

    def __call__(self, inputs: torch.Tensor) -> Documents:
        return Documents.from_inputs(inputs, self.bos_id, self.eos_id)
