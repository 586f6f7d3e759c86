"""Cross-entropy of the output head without materialising the full logits.

The training loss used to be computed as

    logits = model(inputs)                      # (B, S, padded_vocab)
    loss = cross_entropy_reference(logits, labels, vocab_size)

which holds the (tokens, vocab) logits in the matmul dtype, an fp32 copy, the log-softmax
output and the gradients of all three: tens of GB at llama3_1b, seq 8192, vocab 128256.
`fused_linear_cross_entropy` takes the head's *input* (the final-norm output) and the head
weight instead and walks over the tokens in chunks, so that only a (chunk, vocab_local) block
of logits exists at any time. When a gradient is needed it is computed in the same pass (the
gradient of a mean cross-entropy is known as soon as the softmax is), only dL/dhidden and
dL/dweight are kept, and backward merely scales them by the incoming gradient.

With a tensor-parallel group the head is vocab-parallel: each rank multiplies by its rows of
the weight and the softmax normaliser is assembled with two all-reduces per chunk, so the
logits are never gathered.

This module imports nothing beyond torch: it runs (and is tested) on CPU and on CUDA.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "cross_entropy_reference",
    "default_chunk_tokens",
    "fused_linear_cross_entropy",
]

# Logit elements of one chunk. A chunk holds its fp32 logits (which become the softmax and
# then the gradient in place) plus, while it is computed, the matmul output and the gradient in
# the matmul dtype: 4 + 2 bytes an element under bf16 autocast, so 2**28 elements is ~1.5 GiB
# of transient memory. At llama3_1b (vocab 128256, dim 2048) that is ~2090 tokens per chunk:
# GEMMs of 2090 x 2048 x 128256 (~1.1 TFLOP each) that keep an H100 busy, and 16 chunks for a
# 32768-token micro batch, so the per-chunk elementwise launches and (under TP) the two small
# all-reduces are negligible.
DEFAULT_CHUNK_ELEMENTS = 1 << 28
# Chunks are a multiple of this many tokens (when larger), a tidy row count for GEMM tiles.
_CHUNK_ALIGN = 64


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """The loss as train.py computes it from full logits: the padding columns of the vocabulary
    (global ids >= vocab_size) are sliced off, the rest is upcast to fp32, mean cross-entropy
    over the tokens whose label is not `ignore_index` (NaN when every label is ignored)."""
    logits = logits[..., :vocab_size].float()
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index)


def default_chunk_tokens(n_tokens: int, vocab_local: int) -> int:
    """Tokens per chunk so that a chunk has about DEFAULT_CHUNK_ELEMENTS logits."""
    chunk = max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab_local))
    if chunk > _CHUNK_ALIGN:
        chunk -= chunk % _CHUNK_ALIGN
    return max(1, min(chunk, n_tokens))


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` computes in under the current autocast state:
    linear is on autocast's lower-precision list (CUDA and CPU), so under autocast it is the
    autocast dtype; otherwise the inputs' dtype (promoted, where F.linear would refuse)."""
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_stats(logits, row_max, idx, owned):
    """Per row of a logits chunk: the fp32 sum of exp(logit - row_max), and the target's logit
    minus row_max (0 where this rank does not own the target). One fp32 chunk at a time."""
    target = logits.gather(1, idx).squeeze(1).float() - row_max
    exps = torch.sub(logits, row_max.unsqueeze(1))  # a new fp32 block (row_max is fp32)
    return exps.exp_().sum(dim=1), target.masked_fill(~owned, 0.0)


def _chunk_grad(logits, row_max, sum_exp, idx, owned, row_scale):
    """(softmax - onehot(target)) * row_scale in the logits' dtype: the gradient of the mean
    loss w.r.t. a logits chunk (row_scale is 1 / n_valid on valid tokens, else 0). One fp32
    chunk plus the result."""
    grad = torch.sub(logits, row_max.unsqueeze(1)).exp_().div_(sum_exp.unsqueeze(1))
    grad.scatter_add_(1, idx, owned.float().neg().unsqueeze(1))
    return grad.mul_(row_scale.unsqueeze(1)).to(logits.dtype)


def _chunk_grad_fusable(logits, row_max, sum_exp, idx, owned, row_scale):
    """`_chunk_grad` written as one pointwise expression (the onehot as a comparison), which
    torch.compile turns into a single kernel that reads the logits once."""
    x = logits.float()
    softmax = torch.exp(x - row_max.unsqueeze(1)) / sum_exp.unsqueeze(1)
    columns = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    onehot = ((columns == idx) & owned.unsqueeze(1)).float()
    return ((softmax - onehot) * row_scale.unsqueeze(1)).to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _kernels(logits: torch.Tensor):
    """(stats, grad) functions for a chunk. On CUDA compiled with torch.compile, so each reads
    the chunk's logits once in one fused kernel instead of several elementwise passes over
    fp32 copies (several percent of a llama3_1b step); eager elsewhere, or with
    TE_LLAMA_COMPILE_LOSS=0. tests/gpu/test_loss_gpu.py checks both against the reference."""
    if not logits.is_cuda or os.environ.get("TE_LLAMA_COMPILE_LOSS", "1") == "0":
        return _chunk_stats, _chunk_grad
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_chunk_stats, dynamic=False, fullgraph=True)
        _COMPILED["grad"] = torch.compile(_chunk_grad_fusable, dynamic=False, fullgraph=True)
    return _COMPILED["stats"], _COMPILED["grad"]


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, the product computed in a's dtype. On CUDA with bf16/fp16 operands
    the GEMM accumulates into the fp32 buffer directly (addmm with out_dtype), which saves
    writing the product and adding it in a second pass; elsewhere the two-step form."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _COMPILED.get("addmm_out_dtype", True):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):
            _COMPILED["addmm_out_dtype"] = False  # this torch has no such kernel: fall back
    acc.add_(torch.mm(a, b))


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    tp_group,
    chunk_tokens: int | None,
    mm_dtype: torch.dtype,
    need_dhidden: bool,
    need_dweight: bool,
):
    """Loss (0-d fp32) and, if asked, the gradients of the loss w.r.t. hidden and weight (for a
    gradient of 1 on the loss). No host synchronisation: every Python branch is on shapes."""
    # why one function of ~110 lines: one chunk's logits, statistics and gradient live only
    # inside one loop iteration (the memory bound), and the order of its operations is what
    # the bitwise tests against the reference loss hold; pieces would pass them all around.
    dim = hidden.shape[-1]
    vocab_local = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != dim:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden dim {dim}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} vs hidden {tuple(hidden.shape)}")
    if tp_group is None:
        tp_rank, tp_size = 0, 1
    else:
        tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    if not 0 < vocab_size <= vocab_local * tp_size:
        raise ValueError(
            f"vocab_size={vocab_size} outside (0, {vocab_local * tp_size}] "
            f"(weight rows {vocab_local} x tp {tp_size})"
        )

    h = hidden.reshape(-1, dim)
    y = labels.reshape(-1).long()
    n = h.shape[0]
    device = h.device
    # This rank's global ids are [offset, offset + vocab_local); only the first `real` of them
    # are real tokens (the rest, if any, is padding: it takes no probability and no gradient).
    offset = tp_rank * vocab_local
    real = min(max(vocab_size - offset, 0), vocab_local)
    w = weight[:real].to(mm_dtype)

    valid = y != ignore_index
    n_valid = valid.sum()
    # 0 when nothing is valid: the loss and the gradients are then sums of nothing, i.e. 0.
    inv_n = 1.0 / n_valid.clamp(min=1).to(torch.float32)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)

    step = chunk_tokens if chunk_tokens is not None else default_chunk_tokens(n, vocab_local)
    if step < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")

    # Contiguous, written chunk by chunk; zeros where this rank holds no real column.
    dhidden = None
    if need_dhidden:
        dhidden = (torch.empty if real > 0 else torch.zeros)(n, dim, dtype=h.dtype, device=device)
    dweight = (
        torch.zeros(vocab_local, dim, dtype=torch.float32, device=device) if need_dweight else None
    )
    need_grad = need_dhidden or need_dweight

    for start in range(0, n, step):
        end = min(start + step, n)
        y_c = y[start:end]
        valid_c = valid[start:end]
        if real == 0:
            # A rank holding only padding rows: no probability, no gradient, but its part in
            # the collectives (identity elements: max -inf, sums 0).
            row_max = torch.full((end - start,), float("-inf"), device=device)
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
            stats = torch.zeros(2, end - start, device=device)
            dist.all_reduce(stats, group=tp_group)
            token_loss = stats[0].log() - stats[1]
            loss_sum += token_loss.masked_fill_(~valid_c, 0.0).sum()
            continue

        local_id = y_c - offset
        owned = valid_c & (local_id >= 0) & (local_id < real)
        idx = local_id.clamp(0, real - 1).unsqueeze(1)
        h_c = h[start:end].to(mm_dtype)
        # The head's logits exactly as F.linear gives them (matmul dtype); each step below reads
        # them as today's `logits[..., :vocab_size].float()` would (bf16 -> fp32 is exact).
        logits = torch.mm(h_c, w.t())
        row_max = logits.amax(dim=1).float()
        if tp_group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        sum_exp, target = _kernels(logits)[0](logits, row_max, idx, owned)
        if tp_group is not None:
            stats = torch.stack([sum_exp, target])  # (2, c): sum of exp, target logit
            dist.all_reduce(stats, group=tp_group)
            sum_exp, target = stats[0], stats[1]
        # -log softmax[target] = log(sum exp(x - max)) - (x_target - max); 0 for ignored tokens.
        token_loss = sum_exp.log() - target
        loss_sum += token_loss.masked_fill_(~valid_c, 0.0).sum()
        if not need_grad:
            del logits
            continue

        # d(mean loss)/d logits = (softmax - onehot(target)) / n_valid on valid tokens, else 0,
        # cast to the matmul dtype as autograd of `.float()` would.
        row_scale = valid_c.float() * inv_n
        grad = _kernels(logits)[1](logits, row_max, sum_exp, idx, owned, row_scale)
        del logits
        if need_dhidden:
            if dhidden.dtype == mm_dtype:
                torch.mm(grad, w, out=dhidden[start:end])
            else:
                dhidden[start:end].copy_(torch.mm(grad, w))
        if need_dweight:
            # Each chunk's product in the matmul dtype (as the reference's single product),
            # accumulated over the chunks in fp32.
            _accumulate_product(dweight[:real], grad.t(), h_c)
        del grad

    loss = loss_sum * inv_n
    if dhidden is not None:
        dhidden = dhidden.view(hidden.shape)
    if dweight is not None:
        dweight = dweight.to(weight.dtype)
    return loss, dhidden, dweight


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients; backward scales the saved gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, ignore_index, tp_group, chunk, mm_dtype):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Every dtype below is explicit; an enclosing autocast must not re-cast it.
        device_type = hidden.device.type
        args = (hidden, weight, labels, vocab_size, ignore_index, tp_group, chunk, mm_dtype)
        with torch.autocast(device_type, enabled=False):
            loss, dh, dw = _forward(*args, need_dh, need_dw)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        # Scaled in place: the saved tensors are not needed again. (A second backward through
        # the same graph, retain_graph=True, fails autograd's version check instead of silently
        # scaling twice.)
        if dh is not None:
            dh.mul_(grad_loss)
        if dw is not None:
            dw.mul_(grad_loss)
        return dh, dw, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    ignore_index: int = -100,
    tp_group: dist.ProcessGroup | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(hidden, weight)` against `labels`, chunk by chunk.

    Equal (to fp32 round-off) to `cross_entropy_reference(F.linear(hidden, weight), labels,
    vocab_size, ignore_index)` computed under the same autocast state, without ever holding
    more than one (chunk, vocab_local) block of logits.

    Args:
        hidden: (..., D) the final-norm output (bf16 or fp32). Under tensor parallelism the
            same tokens on every rank of `tp_group` (the head's column-parallel input).
        weight: (V_local, D) the output head. Without `tp_group` the whole padded head
            (V_local = padded vocab); with it, rank r's rows, i.e. the global ids
            [r * V_local, (r + 1) * V_local).
        labels: (...) int64 global token ids, same shape as hidden without its last dim, each
            in [0, vocab_size) or equal to `ignore_index` (not checked: that would need a
            host sync; an out-of-range label is owned by no column and counts as logit 0).
        vocab_size: the real vocabulary; columns with global id >= vocab_size are padding, take
            no probability and get zero gradient (exactly the reference's slice).
        ignore_index: label of tokens that do not count (neither in the loss nor in the mean).
        tp_group: vocab-parallel group, or None.
        chunk_tokens: tokens per chunk; default `default_chunk_tokens` (~2**28 logits a chunk).
            Under TP every rank must use the same value (the default is: V_local is equal).

    Returns:
        A 0-d fp32 tensor, the mean over the non-ignored tokens; 0 (with zero gradients) when
        every token is ignored. With `tp_group` the value is identical on every rank.

    Numerics: each chunk's logits are `F.linear`'s matmul in the dtype it would use under the
    current autocast state (bf16 under torch.autocast on CUDA, the inputs' dtype without
    autocast), upcast to fp32; the log-sum-exp and the softmax are fp32. The gradient
    (softmax - onehot) / n_valid is cast to the matmul dtype, as autograd of the reference
    would, and multiplied by the (matmul-dtype) weight and hidden chunk; dL/dweight sums the
    chunks in fp32 and is returned in weight's dtype, dL/dhidden in hidden's dtype.

    Gradients: when autograd needs them (grad mode on and hidden or weight requiring grad)
    they are computed during this forward, and backward multiplies them by the incoming
    gradient (so `(loss / k).backward()` for gradient accumulation works as usual). Otherwise
    (eval, torch.no_grad) only the loss is computed.

    Tensor-parallel gradient contract: with `tp_group`, the gradient returned for `hidden` is
    this rank's PARTIAL sum, the contribution of its vocabulary shard only; the true
    dL/dhidden is the sum over the tp ranks. It is NOT all-reduced here. The caller passes a
    `hidden` that went through `parallel.tp.copy_to_tp` (replicated sequence) or
    `parallel.tp.gather_from_sp` (sequence parallel), whose backward all-reduces or
    reduce-scatters exactly this partial gradient, as for any column-parallel layer. The
    gradient for `weight` is complete for this rank's rows (its rows of the full gradient).
    The loss itself needs no further reduction over tp: the max, the sum of exponentials and
    the target logit are all-reduced over `tp_group` inside (all_reduce only, so gloo and
    NCCL both work).
    """
    mm_dtype = _matmul_dtype(hidden, weight)
    args = (hidden, weight, labels, vocab_size, ignore_index, tp_group, chunk_tokens, mm_dtype)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearCrossEntropy.apply(*args)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        return _forward(*args, False, False)[0]
