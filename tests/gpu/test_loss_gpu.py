"""The chunked loss on CUDA (model/loss.py): the torch.compile'd chunk kernels and the eager
ones give the reference formula's loss and gradients (bf16 under autocast).

    python -m pytest -m gpu tests/gpu/test_loss_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(fused: bool, compiled: bool, hidden, weight, labels, vocab):
    import model.loss as loss_mod

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    saved = dict(loss_mod._COMPILED)
    if not compiled:
        loss_mod._COMPILED.clear()
        loss_mod._COMPILED.update(stats=loss_mod._chunk_stats, grad=loss_mod._chunk_grad)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                loss = loss_mod.fused_linear_cross_entropy(
                    h, w, labels, vocab_size=vocab, chunk_tokens=1000
                )
            else:
                logits = torch.nn.functional.linear(h, w)
                loss = loss_mod.cross_entropy_reference(logits, labels, vocab)
        loss.backward()
    finally:
        loss_mod._COMPILED.clear()
        loss_mod._COMPILED.update(saved)
    return loss.item(), h.grad.float(), w.grad.float()


def test_compiled_and_eager_chunks_match_the_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, dim, padded, vocab = 4096, 512, 32768, 32000
    hidden = torch.randn(n, dim, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(padded, dim, device="cuda", generator=g) * 0.02).float()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = -100
    ref = _run(False, False, hidden, weight, labels, vocab)
    for compiled in (True, False):
        got = _run(True, compiled, hidden, weight, labels, vocab)
        dloss = abs(got[0] - ref[0])
        dh = ((got[1] - ref[1]).norm() / ref[1].norm()).item()
        dw = ((got[2] - ref[2]).norm() / ref[2].norm()).item()
        print(
            f"\ncompiled={compiled}: loss {got[0]:.6f} vs {ref[0]:.6f}, rel dh {dh:.1e}, dw {dw:.1e}"
        )
        assert dloss <= 1e-4 * abs(ref[0])
        assert dh <= 1e-2 and dw <= 1e-2  # bf16 products, chunked fp32 accumulation
