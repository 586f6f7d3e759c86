"""Activation checkpointing: recompute parts of each block in backward instead of keeping their
activations (`parallel.activation_checkpointing`, `parallel.activation_checkpointing_every`).

Modes:

    none       keep every activation (fastest, most memory)
    full       recompute whole blocks: a block keeps only its input (about one extra forward)
    mlp        recompute each block's MLP (norm, fc1, SwiGLU, fc2): its activations are the
               largest part of a block's, its recompute is cheaper than the whole block's
    selective  recompute only what the MLP's backward needs (norm, fc1, SwiGLU; not fc2, whose
               output backward never reads): TE's own LayerNormMLP(checkpoint=True), which
               keeps the block's input and weights instead of the fc1 and SwiGLU outputs
               (the largest activations). The cheapest mode that saves memory; attention and
               its projections keep their activations. The reference model recomputes the
               whole MLP for it (the same numbers; it is the parity implementation, not a
               fast one).

`activation_checkpointing_every=N` applies the mode to blocks 0, N, 2N, ... only, a finer
trade of memory for speed (N=2 recomputes half the blocks).

Mechanism: torch's composable checkpoint on the module (its hooks keep parameter names and
run the module's own hooks again in the recompute, e.g. the tensor-parallel local-weight
hooks of parallel/tp.py). For the TE model the recompute must run in the quantization state of
the forward, or TE saves a different set of tensors ("A different number of tensors was saved
during the original forward and recomputation") and delayed scaling would update its amax
history twice: the recompute re-enters the recipe's autocast for that block (bf16_layers stay
unquantized) inside TE's recompute phase (`get_activation_recompute_contexts`, what TE's own
`te.distributed.checkpoint` uses). torch's checkpoint restores torch.autocast and the RNG
state itself. Applied before FSDP2 (parallel/parallelize.py), so the recompute runs inside the
block's FSDP unit, which is unsharded for backward by then. Every recomputed module is marked
with its block (compat.te.mark_recomputed): TE's FSDP2 hook for quantized weights gathers only
the transposed copy for backward, which a recomputed forward cannot use, and the mark makes the
backward gather keep the rowwise copy too (compat/te.py says how).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from torch import nn

from compat.te import mark_recomputed
from errors import ConfigError

MODES = ("none", "full", "mlp", "selective")


def check_mode(mode: str, every: int) -> None:
    if mode not in MODES:
        raise ConfigError(
            f"parallel.activation_checkpointing={mode!r} is not one of {', '.join(MODES)}"
        )
    if every < 1:
        raise ConfigError(f"parallel.activation_checkpointing_every={every} must be >= 1")


def _te_context_fn(recipe, layer_index: int):
    """(forward context, recompute context) for a TE block: TE's recompute phase plus the
    autocast the forward ran that block in."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.distributed import get_activation_recompute_contexts

    quantized = recipe.is_quantized and not recipe.is_bf16_layer(layer_index)

    def context_fn():
        forward_ctx, recompute_phase = get_activation_recompute_contexts()

        @contextmanager
        def recompute_ctx():
            with ExitStack() as stack:
                stack.enter_context(recompute_phase)
                if recipe.is_quantized:
                    stack.enter_context(te.autocast(enabled=quantized, recipe=recipe.te_recipe()))
                yield

        return forward_ctx, recompute_ctx()

    return context_fn


def apply_activation_checkpointing(
    model: nn.Module, mode: str, every: int = 1, *, impl: str = "torch", recipe=None
) -> list[str]:
    """Checkpoint the blocks (or their MLPs) of `model.layers`; returns the checkpointed
    module names. recipe: the TE model's Recipe (needed for impl="te")."""
    from torch.distributed._composable import checkpoint

    check_mode(mode, every)
    done = []
    if mode == "none":
        return done
    for i, block in enumerate(model.layers):
        if i % every:
            continue
        target, name = (
            (block, f"layers.{i}")
            if mode == "full"
            else (
                block.layernorm_mlp,
                f"layers.{i}.layernorm_mlp",
            )
        )
        done.append(name)
        mark_recomputed(target, block)
        if mode == "selective" and impl == "te":
            # TE recomputes in the forward's quantization state itself (it saves the autocast
            # state and, for delayed scaling, the forward's scales for the recompute).
            target.checkpoint = True
            continue
        if impl == "te":
            checkpoint(target, context_fn=_te_context_fn(recipe, i))
        else:
            checkpoint(target)
    return done
