"""Checkpoint state for TE models that DCP cannot take as TE leaves it.

| gap | upstream | detect | ours | test |
| --- | --- | --- | --- | --- |
| DelayedScaling amax histories and scales live in each module's `_extra_state`, which does not load through DCP under FSDP2 (its size changes once FP8 has run) | TE issue 1860 (open) | modules with a delayed-scaling `fp8_meta` (every TE module under fp8_delayed; the attention modules under fp8_cs/mxfp8/nvfp4 with recipe.fp8_attention) | `TEScalingState` (saved under "te_scaling") | tests/gpu/test_checkpoint_gpu.py (section 3), tests/gpu/test_fp8_attention_gpu.py, tests/test_checkpoint_dist.py |
| FusedAdam states of DTensor parameters are plain per-rank tensors, so they do not reshard | TE PR 2795 (in 2.20) | per state entry, at save | `optimizer_states_as_dtensors` / `optimizer_states_to_local` | tests/test_checkpoint_dist.py::test_plain_optimizer_states_of_dtensor_params_reshard |

Nothing here imports TE: both work on what the modules and the optimizer hold.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model.init import canonical_name

log = logging.getLogger(__name__)


# -- FusedAdam states of DTensor parameters (TE PR 2795) ------------------------------------


def _params_by_fqn(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p for n, p in model.named_parameters()}


def optimizer_states_as_dtensors(osd: dict[str, Any], model: torch.nn.Module) -> set[str]:
    """In a flattened optimizer state dict ("state.<fqn>.<name>"), wrap plain per-rank states
    of DTensor parameters as DTensors with the parameter's placements (what TE FusedAdam does
    itself since PR 2795). Returns the keys wrapped; empty when the optimizer is fine."""
    params = _params_by_fqn(model)
    wrapped = set()
    for key, value in osd.items():
        if (
            not key.startswith("state.")
            or not isinstance(value, torch.Tensor)
            or isinstance(value, DTensor)
            or value.ndim == 0
        ):
            continue
        fqn = key[len("state.") :].rsplit(".", 1)[0]
        p = params.get(fqn)
        if isinstance(p, DTensor) and value.shape == p._local_tensor.shape:
            osd[key] = DTensor.from_local(
                value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
            wrapped.add(key)
    if wrapped:
        log.info(
            "checkpoint: %d optimizer states of DTensor params were plain tensors; saved "
            "as DTensors (TE FusedAdam before PR 2795)",
            len(wrapped),
        )
    return wrapped


def optimizer_states_to_local(osd: dict[str, Any], keys: set[str]) -> None:
    """Undo `optimizer_states_as_dtensors` on loaded values, for an optimizer that wants
    plain per-rank states back."""
    for key in keys:
        if isinstance(osd.get(key), DTensor):
            osd[key] = osd[key].to_local()


# -- DelayedScaling amax histories and scales (TE issue 1860) ---------------------------------


def _delayed_scaling_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        canonical_name(n): m
        for n, m in model.named_modules()
        if isinstance(getattr(m, "fp8_meta", None), dict)
    }


def _is_attention(module: torch.nn.Module) -> bool:
    """TE's DotProductAttention (each TransformerLayer's `self_attention.core_attention`),
    known by its class name so that nothing here imports TE."""
    return any(c.__name__ == "DotProductAttention" for c in type(module).__mro__)


def delayed_scaling_state(model: torch.nn.Module, recipe: Any, attention_recipe: Any = None):
    """TEScalingState for the TE modules that keep delayed-scaling state, else None.

    recipe: the run's TE recipe; a DelayedScaling one covers every TE module (attention with
    fp8_dpa included: TE runs it under the same recipe). attention_recipe: under another recipe
    with FP8 attention (fp8_cs, mxfp8, nvfp4 + recipe.fp8_attention), the DelayedScaling TE's
    attention modules hold (`Recipe.attention_te_recipe`): their state alone is kept, and
    loaded with that recipe, equal to the one TE builds at their next forward, so TE keeps the
    loaded scales (set_meta_tensor leaves delayed-scaling state under a delayed recipe as it
    is). The Linear modules' current or block scaling has no state to keep."""
    if recipe is not None and getattr(recipe, "delayed", lambda: False)():
        modules = _delayed_scaling_modules(model)
        return TEScalingState(modules, recipe) if modules else None
    if attention_recipe is None:
        return None
    modules = {n: m for n, m in _delayed_scaling_modules(model).items() if _is_attention(m)}
    return TEScalingState(modules, attention_recipe) if modules else None


_TENSORS = (
    ("scaling_fwd", "scale", "scale_fwd"),
    ("scaling_fwd", "amax_history", "amax_history_fwd"),
    ("scaling_bwd", "scale", "scale_bwd"),
    ("scaling_bwd", "amax_history", "amax_history_bwd"),
)


def _max_over_ranks_newest_amax(sd: dict[str, Any]) -> None:
    """Replace the amax histories in `sd` by copies holding their maximum over all ranks.

    Older rows are reduced already (autocast reduces with max over all ranks, the recipe's
    default group), but the newest row can hold amaxes this rank recorded since, unreduced:
    FusedAdam writes the amax of the updated weight after the step, and when the weight is
    split over ranks (FSDP or TP shards) each rank records the amax of its own piece. One copy
    is saved, so without this every rank would resume with rank 0's pieces' amaxes; with it
    every rank resumes with their maximum, which is exactly what the next reduction computes
    from the original values. The live histories are not touched."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    keys = [
        (name, out)
        for name, entry in sd.items()
        for _, attr, out in _TENSORS
        if attr == "amax_history"
    ]
    if not keys:
        return
    flat = torch.cat([sd[name][out].detach().reshape(-1).float() for name, out in keys])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    offset = 0
    for name, out in keys:
        live = sd[name][out]
        n = live.numel()
        sd[name][out] = flat[offset : offset + n].view_as(live).to(live.dtype)
        offset += n


class TEScalingState:
    """DelayedScaling amax histories and scales of every TE module, as plain replicated
    tensors keyed by module name: what `_extra_state` carries, in a form DCP loads under
    FSDP2 and across layouts. With the amax reduced over all ranks (autocast's
    amax_reduction_group) these are identical on every rank, so one copy is kept."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], recipe: Any):
        self.modules = dict(modules)
        self.recipe = recipe

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for name, m in self.modules.items():
            meta = m.fp8_meta
            if not all(
                hasattr(meta.get(k), "amax_history") for k in ("scaling_fwd", "scaling_bwd")
            ):
                continue  # FP8 has not run in this module yet
            entry: dict[str, Any] = {"num_gemms": int(meta.get("num_gemms", 1))}
            for key, attr, out in _TENSORS:
                entry[out] = getattr(meta[key], attr)
            sd[name] = entry
        _max_over_ranks_newest_amax(sd)
        return sd

    def load_request(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        request: dict[str, dict[str, Any]] = {}
        for flat, md in saved.items():
            name, leaf = flat.rsplit(".", 1)
            if name not in self.modules:
                continue
            if hasattr(md, "size"):  # TensorStorageMetadata
                value: Any = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="cuda")
            else:
                value = 0
            request.setdefault(name, {})[leaf] = value
        return request

    @torch.no_grad()
    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        for name, entry in sd.items():
            m = self.modules[name]
            # What TE's own set_extra_state does, minus the pickle: set the recipe, allocate
            # the meta tensors, copy. The first forward keeps them (same recipe type).
            m.fp8_meta["num_gemms"] = int(entry["num_gemms"])
            m.fp8_meta["recipe"] = self.recipe
            m.fp8_meta["fp8_checkpoint"] = True
            m.init_fp8_meta_tensors(self.recipe)
            for key, attr, out in _TENSORS:
                dst = getattr(m.fp8_meta[key], attr)
                src = entry[out].to(dst.device)
                if dst.shape != src.shape:  # amax_history_len changed: keep the newest rows
                    rows = min(dst.shape[0], src.shape[0])
                    dst.zero_()
                    dst[:rows].copy_(src[:rows])
                else:
                    dst.copy_(src)
