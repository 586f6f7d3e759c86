"""MFU's FLOP count (model/flops.py, logger.StepClock, steps.BatchLayout) against a hand count.

The attention part counts the (query, key) pairs each document really has under causal
masking; a window of short documents must not be counted as one causal window (which read
above 100% MFU at long sequences).
"""

from __future__ import annotations

import pytest
import torch

from data.documents import Documents
from logger import StepClock
from model.config import ModelConfig
from model.flops import (
    attention_flops_per_pair,
    batch_attention_pairs,
    causal_row_flops_per_token,
    dense_flops_per_token,
    matmul_params,
    step_flops,
)
from steps import BatchLayout

CFG = ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128)


def test_counts_equal_a_hand_count():
    # head_dim 16; per layer: Q and O 64x64 each, K and V 64x32 each, fc1 64x192, fc2 96x64;
    # head 64x128 (vocab padded to 128).
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 64 * 2 * 96 + 96 * 64
    assert matmul_params(CFG) == 3 * per_layer + 64 * 128
    assert dense_flops_per_token(CFG) == 6 * (3 * per_layer + 64 * 128)
    # A pair: score (2 x 16) + weighted sum (2 x 16) forward, x3 with backward, 4 heads, 3 layers.
    assert attention_flops_per_pair(CFG) == (2 * 16 + 2 * 16) * 3 * 4 * 3
    # Two rows of 8: documents of 3 and 5 tokens, then one of 8. Pairs: 6 + 15 + 36.
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    assert batch_attention_pairs((2, 8), cu) == 57
    assert batch_attention_pairs((2, 8)) == 2 * 36  # no documents: causal rows
    assert step_flops(CFG, 16, 57) == 16 * dense_flops_per_token(CFG) + 57 * 2304


def test_layout_counts_the_documents_before_the_context_parallel_split():
    # BOS=1 starts a document (data/documents.py's rule); rows of 8 inputs (+1 label).
    rows = torch.tensor([[1, 5, 5, 1, 5, 5, 5, 5, 5], [1, 5, 5, 5, 5, 5, 5, 5, 5]])
    boundaries = lambda x: Documents.from_inputs(x, 1, 2)  # noqa: E731
    layout = BatchLayout(boundaries)
    layout(rows)
    assert layout.attention_pairs == 6 + 15 + 36
    causal = BatchLayout(None)
    causal(rows)
    assert causal.attention_pairs == 2 * 36


def test_mfu_uses_the_steps_documents(monkeypatch):
    """Two steps of 4 rows x 1024 tokens in 2 s on 2 devices at 1 TFLOP/s peak each: MFU from
    the documents' pairs; a window of 64-token documents costs far less attention than a
    causal window."""
    seq, rows = 1024, 4
    times = iter([0.0, 2.0, 3.0])
    monkeypatch.setattr("logger.time.perf_counter", lambda: next(times))
    clock = StepClock(
        start_step=0,
        total_steps=10,
        tokens_per_step=rows * seq,
        step_flops=lambda tokens, pairs: step_flops(CFG, tokens, pairs),
        peak_tflops=1.0,
        world_size=2,
    )
    docs = rows * (seq // 64) * (64 * 65 // 2)
    for _ in range(2):
        clock.count(docs)
    pairs = clock.take_pairs()
    assert pairs == 2 * docs and clock.take_pairs() == 0
    got = clock.measure(2, attention_pairs=pairs)
    assert clock.measure(3)["mfu"] is None  # no pairs given: no MFU
    flops = 2 * rows * seq * dense_flops_per_token(CFG) + 2 * docs * attention_flops_per_pair(CFG)
    assert got["mfu"] == pytest.approx(flops / (2.0 * 2 * 1e12))
    # A causal window per row would count (seq + 1) / 65 times the documents' attention.
    causal = 2 * rows * seq * (seq + 1) // 2
    assert causal / pairs == pytest.approx((seq + 1) / 65)


def test_memory_summary_replays_the_allocator_trace_to_its_peak():
    from profiling import memory_summary

    gib = 2**30

    def frames(file, line):
        return [
            {"filename": "/x/torch/cuda/memory.py", "line": 1, "name": "alloc"},
            {"filename": f"/repo{file}", "line": line, "name": "f"},
        ]

    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": frames("/model/llama.py", 10)},
        {"action": "alloc", "addr": 2, "size": 1 * gib, "frames": frames("/steps.py", 20)},
        {"action": "free_completed", "addr": 99, "size": 1 * gib},  # allocated before the steps
        {"action": "alloc", "addr": 3, "size": 3 * gib, "frames": frames("/model/llama.py", 10)},
        {"action": "free_completed", "addr": 1, "size": 2 * gib},  # after the peak
        {"action": "alloc", "addr": 4, "size": 1 * gib, "frames": frames("/steps.py", 20)},
    ]
    text = memory_summary(trace, base=10 * gib, steps=[5, 6])
    # Peak after the third alloc: 10 - 1 + 2 + 1 + 3 = 15 GiB; alive then: 5 + 1 GiB by site.
    assert "- peak: 15.00 GiB = the rest of that 9.00 GiB + 6.00 GiB" in text
    assert "| model/llama.py:10 f | 5.00 | 2 |" in text  # the last two path parts
    assert "| repo/steps.py:20 f | 1.00 | 1 |" in text


def test_causal_row_cost_per_token():
    # One causal row of 8 tokens: 36 pairs over 8 tokens.
    per_token = causal_row_flops_per_token(CFG, 8)
    assert per_token == pytest.approx(dense_flops_per_token(CFG) + 36 / 8 * 2304)
