"""Fixes for gaps in torch and TransformerEngine, in one place, applied once by train.py.

    from compat import apply_all
    applied = apply_all()      # before the model is built; returns what was patched

compat/te.py holds the TE gaps, compat/fsdp2.py the torch FSDP2 gaps. Each module's docstring
has a table: the gap, the upstream issue or PR it stands in for, how the missing feature is
detected, the fix, and the test that shows the upstream failure without the fix (so each fix
can be retired the day upstream ships its own). State that checkpoints carry (TE scaling
state, optimizer-state wrappers) lives in checkpoint/te_state.py.
"""

from __future__ import annotations

from typing import Any

from compat import fsdp2, te


def apply_all() -> dict[str, Any]:
    """Apply every process-wide fix this environment needs (idempotent). Without CUDA + TE only
    the FSDP2 fixes apply (they matter only for tensor classes that register with them)."""
    applied: dict[str, Any] = {"fsdp2_one_rank_inputs": fsdp2.ensure_one_rank_keeps_all_inputs()}
    if te.te_importable():
        applied.update(
            te_untyped_storage=te.ensure_quantized_tensor_storage(),
            te_fused_adam_fp8_cache=te.ensure_fused_adam_fp8_cache_reset(),
            te_post_all_gather_dtensor_out=te.ensure_post_all_gather_dtensor_out(),
            te_dim1_block_gather=te.ensure_dim1_block_gather(),
            te_recompute_gathers_rowwise=te.ensure_recompute_gathers_rowwise(),
        )
    return applied
