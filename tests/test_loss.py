"""model/loss.py: the chunked (and vocab-parallel) linear + cross-entropy against today's formula.

The reference is what train.py does: full logits from F.linear (under the same autocast
state), `cross_entropy_reference`, and autograd for the gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.loss import (
    DEFAULT_CHUNK_ELEMENTS,
    cross_entropy_reference,
    default_chunk_tokens,
    fused_linear_cross_entropy,
)
from parallel.tp import copy_to_tp
from tests.distributed import run_distributed
from tools.bench_loss import cpu_peak_bytes

IGNORE = -100


def _autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def make_inputs(shape, dim, padded, vocab, *, seed=0, ignore_frac=0.2, hidden_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, dim, generator=g).to(hidden_dtype)
    # Scaled so the logits have a spread like a trained head's (std ~3), not a uniform softmax.
    weight = torch.randn(padded, dim, generator=g) * (3.0 / dim**0.5)
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignore_frac] = IGNORE
    return hidden, weight, labels


def reference(hidden, weight, labels, vocab, *, bf16=False):
    """Loss and gradients the way train.py gets them today."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    with _autocast(bf16):
        logits = F.linear(h, w)
    loss = cross_entropy_reference(logits, labels, vocab, IGNORE)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def fused(hidden, weight, labels, vocab, *, bf16=False, chunk=None, scale=1.0):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    with _autocast(bf16):
        loss = fused_linear_cross_entropy(
            h, w, labels, vocab_size=vocab, ignore_index=IGNORE, chunk_tokens=chunk
        )
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def assert_close_rel(actual, expected, rel):
    """Elementwise within `rel` of the largest reference entry, and the whole tensor within
    `rel` in relative norm."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)
    assert rel_err(actual, expected) <= rel


# (shape of the tokens, dim, padded vocab, real vocab, chunk_tokens)
CASES = [
    ((37,), 16, 40, 35, 5),  # odd token count, chunk does not divide it, padding columns
    ((3, 11), 24, 64, 64, 7),  # (B, S) tokens, no padding
    ((2, 50), 32, 96, 90, None),  # default chunk (one chunk at this size)
    ((1,), 8, 16, 13, 4),  # a single token, chunk larger than N
    ((29,), 16, 32, 30, 1),  # one token a chunk
    ((4, 33), 64, 256, 250, 64),  # several full chunks and a ragged tail
]


@pytest.mark.parametrize("shape,dim,padded,vocab,chunk", CASES)
def test_fp32_matches_reference(shape, dim, padded, vocab, chunk):
    hidden, weight, labels = make_inputs(shape, dim, padded, vocab, seed=len(CASES) + dim)
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels, vocab)
    loss, dh, dw = fused(hidden, weight, labels, vocab, chunk=chunk)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_close_rel(dh, ref_dh, 1e-6)
    assert_close_rel(dw, ref_dw, 1e-6)
    # Padding rows of the head take no probability: exactly zero gradient, as in the reference.
    assert torch.equal(dw[vocab:], torch.zeros_like(dw[vocab:]))


# bf16 tolerance. Both sides compute the same bf16 logits (bf16 GEMM, fp32 accumulation,
# rounded to bf16) and an fp32 softmax, so the loss agrees to fp32 round-off (checked to 1e-5).
# The gradients differ by bf16 rounding only: the fp32 (softmax - onehot)/n is cast to bf16 on
# both sides, but tiny fp32 differences can flip that rounding of an element (1 bf16 ulp =
# 2**-8 relative); the reference rounds its single dW product to bf16 once, the fused version
# rounds each chunk's product (<= 2**-9 relative each) and sums the chunks in fp32; dL/dhidden
# is one bf16 product per token on both sides. Observed on these cases: dL/dhidden equal,
# dL/dW ~2.5e-3 apart in relative norm (~4e-3 of the largest entry elementwise), each side
# ~1.7e-3 from the exact product (checked below: the fused dW is as accurate as the
# reference's). 2**-6 ~ 1.6% of the largest entry, elementwise and in relative norm, bounds
# this with margin and still fails for any real error (a wrong row, a missed chunk, a scale).
BF16_REL = 2.0**-6


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim,padded,vocab,chunk", CASES[:2] + CASES[-1:])
def test_bf16_autocast_matches_reference(shape, dim, padded, vocab, chunk, hidden_dtype):
    hidden, weight, labels = make_inputs(shape, dim, padded, vocab, hidden_dtype=hidden_dtype)
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels, vocab, bf16=True)
    loss, dh, dw = fused(hidden, weight, labels, vocab, bf16=True, chunk=chunk)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert dh.dtype == hidden_dtype and dw.dtype == torch.float32
    assert_close_rel(dh, ref_dh, BF16_REL)
    assert_close_rel(dw, ref_dw, BF16_REL)
    assert torch.equal(dw[vocab:], torch.zeros_like(dw[vocab:]))
    # bf16 and not fp32 really was used: the fp32 loss differs by more than fp32 round-off.
    fp32_loss, _, _ = reference(hidden.float(), weight, labels, vocab)
    assert (loss - fp32_loss).abs() > 1e-4 * fp32_loss.abs()
    # Both dW against the exact (fp64) product of the reference's bf16 logit gradient and the
    # bf16 hidden: chunking (per-chunk bf16 rounding, fp32 sum) costs no accuracy.
    logits = F.linear(hidden.bfloat16(), weight.bfloat16()).detach().requires_grad_()
    cross_entropy_reference(logits, labels, vocab, IGNORE).backward()
    exact = logits.grad.reshape(-1, padded).double().T @ hidden.reshape(-1, dim).bfloat16().double()
    ref_err, fused_err = rel_err(ref_dw, exact), rel_err(dw, exact)
    assert ref_err < 2.0**-8 and fused_err <= max(1.5 * ref_err, 2.0**-9), (ref_err, fused_err)


def test_non_contiguous_inputs():
    """A (S, B, D) activation transposed to (B, S, D), int32 labels."""
    hidden, weight, labels = make_inputs((11, 3), 16, 40, 37)
    hidden, labels = hidden.transpose(0, 1), labels.t()
    assert not hidden.is_contiguous()
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels, 37)
    h = hidden.detach().clone().requires_grad_()  # clone keeps the transposed strides
    assert not h.is_contiguous()
    w = weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels.int(), vocab_size=37, chunk_tokens=4)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=0)
    assert_close_rel(h.grad, ref_dh, 1e-6)
    assert_close_rel(w.grad, ref_dw, 1e-6)


def test_all_ignored_gives_zero_not_nan():
    hidden, weight, _ = make_inputs((13,), 16, 24, 20)
    labels = torch.full((13,), IGNORE)
    ref_loss, _, _ = reference(hidden, weight, labels, 20)
    assert ref_loss.isnan()  # today's formula: 0 / 0
    for bf16 in (False, True):
        loss, dh, dw = fused(hidden, weight, labels, 20, bf16=bf16, chunk=4)
        assert loss.item() == 0.0
        assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_custom_ignore_index():
    hidden, weight, labels = make_inputs((21,), 16, 24, 20, ignore_frac=0.0)
    labels[::3] = 7  # a real id used as the ignore index
    h = hidden.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(h, weight)[:, :20], labels, ignore_index=7)
    ref.backward()
    h2 = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h2, weight, labels, vocab_size=20, ignore_index=7)
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)
    assert_close_rel(h2.grad, h.grad, 1e-6)


@pytest.mark.parametrize("bf16", [False, True])
def test_grad_accumulation(bf16):
    """Two micro batches, each loss / 2, backward into the same leaves (as train.py does)."""
    hidden, weight, labels = make_inputs((2, 23), 32, 72, 70)
    results = {}
    for name in ("ref", "fused"):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        for i in range(2):
            with _autocast(bf16):
                if name == "ref":
                    loss = cross_entropy_reference(F.linear(h[i], w), labels[i], 70, IGNORE)
                else:
                    loss = fused_linear_cross_entropy(
                        h[i], w, labels[i], vocab_size=70, chunk_tokens=6
                    )
            (loss / 2).backward()
        results[name] = (h.grad, w.grad)
    rel = BF16_REL if bf16 else 1e-6
    for a, b in zip(results["fused"], results["ref"]):
        assert_close_rel(a, b, rel)


def test_grad_scaled_by_upstream_gradient():
    """A scale that is not a power of two reaches the gradients exactly like autograd's."""
    hidden, weight, labels = make_inputs((31,), 16, 48, 45)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    (0.37 * cross_entropy_reference(F.linear(h, w), labels, 45, IGNORE)).backward()
    _, dh, dw = fused(hidden, weight, labels, 45, chunk=8, scale=0.37)
    assert_close_rel(dh, h.grad, 1e-6)
    assert_close_rel(dw, w.grad, 1e-6)


def test_no_grad_and_frozen_head():
    hidden, weight, labels = make_inputs((3, 17), 16, 40, 36)
    ref_loss, ref_dh, _ = reference(hidden, weight, labels, 36)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(
            hidden.requires_grad_(), weight.requires_grad_(), labels, vocab_size=36, chunk_tokens=5
        )
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    # Only hidden needs a gradient: the head's is neither computed nor returned.
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone()
    fused_linear_cross_entropy(h, w, labels, vocab_size=36, chunk_tokens=5).backward()
    assert w.grad is None
    assert_close_rel(h.grad, ref_dh, 1e-6)


def test_second_backward_through_graph_is_refused():
    """backward scales the saved gradients in place; a retained graph must not reuse them."""
    hidden, weight, labels = make_inputs((9,), 8, 16, 16)
    h = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, labels, vocab_size=16)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_default_chunk_tokens():
    # llama3_1b: 2**28 / 128256 = 2092.9 -> 2048 tokens (a multiple of 64), 16 chunks of 32768.
    assert default_chunk_tokens(32768, 128256) == 2048
    assert default_chunk_tokens(32768, 128256 // 2) == 4160  # tp=2: V_local halves
    assert default_chunk_tokens(100, 1000) == 100  # never more than the tokens
    assert default_chunk_tokens(10, DEFAULT_CHUNK_ELEMENTS * 4) == 1  # at least one token


def test_rejects_bad_arguments():
    hidden, weight, labels = make_inputs((5,), 8, 16, 16)
    with pytest.raises(ValueError, match="vocab_size"):
        fused_linear_cross_entropy(hidden, weight, labels, vocab_size=17)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_linear_cross_entropy(hidden, weight, labels, vocab_size=16, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_cross_entropy(hidden, weight, labels[:4], vocab_size=16)


# ---------------------------------------------------------------------------------------------
# Memory: no (N, V) logits block, measured two ways.


class _LargestFloatTensor(TorchDispatchMode):
    """Records the largest floating-point tensor any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.shape = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > self.largest:
                self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


N_MEM, D_MEM, V_MEM, CHUNK_MEM = 2048, 32, 4000, 128


def _memory_run(kind: str, bf16: bool):
    hidden, weight, labels = make_inputs((N_MEM,), D_MEM, V_MEM, V_MEM - 5, seed=3)
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def run():
        with _autocast(bf16):
            if kind == "ref":
                loss = cross_entropy_reference(F.linear(h, w), labels, V_MEM - 5, IGNORE)
            else:
                loss = fused_linear_cross_entropy(
                    h, w, labels, vocab_size=V_MEM - 5, chunk_tokens=CHUNK_MEM
                )
        loss.backward()

    return run


@pytest.mark.parametrize("bf16", [False, True])
def test_no_full_logits_tensor(bf16):
    full = N_MEM * V_MEM
    mode = _LargestFloatTensor()
    with mode:
        _memory_run("fused", bf16)()
    assert mode.largest <= CHUNK_MEM * V_MEM, mode.shape
    # The detector does see the reference's (N, V) logits.
    ref_mode = _LargestFloatTensor()
    with ref_mode:
        _memory_run("ref", bf16)()
    assert ref_mode.largest >= full, ref_mode.shape


@pytest.mark.parametrize("bf16", [False, True])
def test_peak_memory_is_a_few_chunks(bf16):
    fused_peak = cpu_peak_bytes(_memory_run("fused", bf16))
    ref_peak = cpu_peak_bytes(_memory_run("ref", bf16))
    # Held across the whole call: dL/dhidden (hidden's dtype), dL/dW in fp32 and in the
    # returned weight.grad, the weight in the matmul dtype. Transient per chunk: fp32 logits
    # (softmax, gradient in place) + matmul-dtype logits and gradient: <= 3 fp32 blocks.
    resident = 4 * (N_MEM * D_MEM + 3 * V_MEM * D_MEM)
    bound = resident + 3 * 4 * CHUNK_MEM * V_MEM
    assert fused_peak <= bound, (fused_peak, bound)
    # Less than a single fp32 (N, V) logits tensor; today's formula needs several of them.
    assert fused_peak < 4 * N_MEM * V_MEM / 4
    assert ref_peak > 4 * N_MEM * V_MEM
    print(f"bf16={bf16}: peak fused {fused_peak / 2**20:.1f} MiB, ref {ref_peak / 2**20:.1f} MiB")


# ---------------------------------------------------------------------------------------------
# Vocab-parallel over gloo.


def _tp_check(rank, world, bf16):
    group = dist.new_group(list(range(world)))
    # The last rank of tp=4 holds padding rows only (ids 36..47 >= 35).
    padded, vocab, dim = 48, 35 if world == 4 else 45, 16
    for shape, chunk, ignore_frac, seed in (((3, 19), 5, 0.2, 1), ((40,), None, 0.0, 2)):
        hidden, weight, labels = make_inputs(
            shape, dim, padded, vocab, seed=seed, ignore_frac=ignore_frac
        )
        ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels, vocab, bf16=bf16)
        rows = padded // world
        w_full = weight[rank * rows : (rank + 1) * rows]
        rel = BF16_REL if bf16 else 1e-6

        for via_copy in (False, True):
            h = hidden.clone().requires_grad_()
            w = w_full.clone().requires_grad_()
            with _autocast(bf16):
                x = copy_to_tp(h, group) if via_copy else h
                loss = fused_linear_cross_entropy(
                    x, w, labels, vocab_size=vocab, tp_group=group, chunk_tokens=chunk
                )
            loss.backward()
            dh = h.grad.clone()
            if not via_copy:
                # The returned gradient is this rank's partial: the caller's copy_to_tp sums it.
                dist.all_reduce(dh, group=group)
            torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5 if bf16 else 1e-6, atol=0)
            losses = [torch.zeros(()) for _ in range(world)]
            dist.all_gather(losses, loss.detach(), group=group)
            assert all(torch.equal(x, losses[0]) for x in losses), losses
            assert_close_rel(dh, ref_dh, rel)
            expected_dw = ref_dw[rank * rows : (rank + 1) * rows]
            if expected_dw.abs().max() == 0:  # a rank of padding rows only
                assert torch.equal(w.grad, expected_dw)
            else:
                assert_close_rel(w.grad, expected_dw, rel)

        with torch.no_grad(), _autocast(bf16):
            loss = fused_linear_cross_entropy(
                hidden, w_full, labels, vocab_size=vocab, tp_group=group, chunk_tokens=chunk
            )
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5 if bf16 else 1e-6, atol=0)

    # Every token ignored: 0 on every rank, zero gradients.
    hidden, weight, _ = make_inputs((7,), dim, padded, vocab)
    h = hidden.clone().requires_grad_()
    w = weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    loss = fused_linear_cross_entropy(
        h, w, torch.full((7,), IGNORE), vocab_size=vocab, tp_group=group, chunk_tokens=3
    )
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


@pytest.mark.slow
@pytest.mark.parametrize("world,bf16", [(2, False), (2, True), (4, False)])
def test_vocab_parallel_matches_reference(world, bf16):
    run_distributed(_tp_check, world, bf16)


def test_fusable_gradient_form_equals_the_in_place_form():
    """The expression torch.compile fuses on CUDA (`_chunk_grad_fusable`) computes the same
    gradient as the in-place form used elsewhere (`_chunk_grad`), here both eager."""
    from model.loss import _chunk_grad, _chunk_grad_fusable, _chunk_stats

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(37, 53, generator=g) * 3).to(dtype)
        idx = torch.randint(0, 53, (37, 1), generator=g)
        owned = torch.rand(37, generator=g) > 0.3
        row_max = logits.amax(dim=1).float()
        sum_exp, _ = _chunk_stats(logits, row_max, idx, owned)
        scale = (torch.rand(37, generator=g) > 0.2).float() / 29
        a = _chunk_grad(logits, row_max, sum_exp, idx, owned, scale)
        b = _chunk_grad_fusable(logits, row_max, sum_exp, idx, owned, scale)
        assert a.dtype == b.dtype == dtype
        tol = 1e-7 if dtype == torch.float32 else 2**-8 * a.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol
