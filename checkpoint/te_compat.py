"""Fixes TE needs for training and checkpointing quantized models, each applied only where
missing.

Every fix detects the upstream feature (by what the installed TE does or defines, never by its
version number) and patches only when it is absent. Nothing here imports TE at module level:
CPU runs and the reference model never touch it.

| fix | upstream | detect | ours |
| --- | --- | --- | --- |
| empty `untyped_storage` on QuantizedTensor: FSDP2's reset_sharded_param after a DCP load compares storages and crashes on the wrapper subclass | TE PR 2974 (in 2.20) | `QuantizedTensor` defines `untyped_storage` | `ensure_quantized_tensor_storage` |
| QuantizedTensor copies to CPU keeping its type (DCP staging without dequantizing) | TE PR 2974 (in 2.20) | `.cpu()` of a quantized tensor stays quantized | `quantized_staging_supported` (asserted by tests/gpu; no patch) |
| FusedAdam states are DTensors for DTensor params, so they reshard | TE PR 2795 (in 2.20) | per state entry, at save | `optimizer_states_as_dtensors` / `optimizer_states_to_local` |
| DelayedScaling amax history + scales through DCP under FSDP2 (`_extra_state` does not load) | missing (TE issue 1860) | modules with delayed-scaling `fp8_meta` | `delayed_scaling_state` (TEScalingState) |
| amax reduction group of current-scaling / NVFP4 weight shards when the param mesh has 2+ dims (FSDP x TP, HSDP): TE looks up the dim named "shard" (ours: dp_shard) and raises | missing (PR 2974 added NVFP4 to the 1-D case) | reset_parameters source asks for `mesh_dim="shard"` | `ensure_shard_amax_group` |
| FSDP2 + tensor parallel: from the second all-gather on, torch passes the existing unsharded parameter as `out=` to `fsdp_post_all_gather`, and for a TP weight that is a DTensor; TE's quantized tensors use `out` as a quantized tensor (`'DTensor' object has no attribute '_quantizer'`). Same call: for a weight FSDP shards along dim 1 (fc1 under TP) the gathered buffer arrives viewed as (world x rows, cols / world) and TE sets it as the weight's data | missing (TE PR 2713, DTensor weights, unmerged) | the method's source never mentions DTensor | `ensure_post_all_gather_dtensor_out` (`wrap_post_all_gather`) |
| FusedAdam's fused FP8 kernel (delayed-scaling Float8Tensor params) rewrites the FP8 bytes in place but leaves the param's cached FP8 transpose valid; on Hopper the next backward's dgrad GEMM reads that stale transpose (the weights of the step the cache was made), so training drifts and a resume (fresh transpose) is not bitwise | missing in 2.20.2 | FusedAdam.step source never calls `_reset_caches` | `ensure_fused_adam_fp8_cache_reset` |

Two torch FSDP2 gaps for weights that all-gather more than one tensor (FP8 blocks, MXFP8,
NVFP4: data + scales), fixed here too:

| gap | detect | ours |
| --- | --- | --- |
| one-rank shard mesh (dp_shard = 1 on several processes: ddp, tp, hsdp_tp 2x1x2): `FSDPParamGroup.wait_for_unshard` skips the all-gather and hands only `all_gather_inputs[0]` to `fsdp_post_all_gather` (`ValueError: not enough values to unpack`) | that method's source takes `all_gather_inputs[0]` | `ensure_one_rank_keeps_all_inputs` |
| weight sharded along dim 1 (fc1 under TP, parallel/tp.py): the copy-out chunk-cats every output viewed in the weight's shard shape, which scales do not have (`shape '[3072, 256]' is invalid for input of size 96`) | `foreach_all_gather_copy_out` source chunk-cats by `padded_sharded_param_size` | `ensure_dim1_block_gather`: FP8 128x128 blocks gathered in dim-0 order, regrouped before TE's post-all-gather (`regroup_dim1_blocks`); MXFP8 / NVFP4 scale layouts along dim 1 are not handled, and the config check refuses them there (recipes/recipe.py) |
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recipes.amax import local_tensor

log = logging.getLogger(__name__)

_PATCHED: dict[str, bool] = {}


def te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def _quantized_tensor_cls():
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    return QuantizedTensor


# -- 1. QuantizedTensor.untyped_storage ---------------------------------------------------


def quantized_tensor_has_storage_fix() -> bool:
    return "untyped_storage" in vars(_quantized_tensor_cls())


def _empty_untyped_storage(self) -> torch.UntypedStorage:
    # The bytes live in the inner buffers; an empty storage never equals a real one, so FSDP2
    # re-records its sharded view after a load instead of dereferencing an invalid storage.
    return torch.UntypedStorage(0, device=self.device)


def ensure_quantized_tensor_storage() -> bool:
    """Give QuantizedTensor an empty `untyped_storage` when TE does not. True if patched."""
    if not te_importable():
        return False
    cls = _quantized_tensor_cls()
    if quantized_tensor_has_storage_fix():
        return _PATCHED.get("storage", False)
    cls.untyped_storage = _empty_untyped_storage
    _PATCHED["storage"] = True
    log.info("te_compat: QuantizedTensor.untyped_storage patched (TE lacks PR 2974)")
    return True


# -- 2. staging quantized tensors without dequantizing ------------------------------------


def quantized_staging_supported() -> bool:
    """Does `.cpu()` keep a TE quantized tensor quantized (needs CUDA)?"""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cuda"))
    x = q(torch.ones(16, 16, device="cuda"))
    return isinstance(x.cpu(), _quantized_tensor_cls())


# -- 3. DTensor optimizer states ------------------------------------------------------------


def _params_by_fqn(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from model.init import canonical_name

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
            "te_compat: %d optimizer states of DTensor params were plain tensors; saved "
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


def fused_adam_has_dtensor_states() -> bool:
    from transformer_engine.pytorch.optimizers import FusedAdam

    return "DTensor" in inspect.getsource(FusedAdam._initialize_state)


# -- 4. DelayedScaling state -----------------------------------------------------------------


def _delayed_scaling_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from model.init import canonical_name

    return {
        canonical_name(n): m
        for n, m in model.named_modules()
        if isinstance(getattr(m, "fp8_meta", None), dict)
    }


def delayed_scaling_state(model: torch.nn.Module, recipe: Any):
    """TEScalingState for models with TE modules under a DelayedScaling recipe, else None."""
    if recipe is None or not getattr(recipe, "delayed", lambda: False)():
        return None
    modules = _delayed_scaling_modules(model)
    return TEScalingState(modules, recipe) if modules else None


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


# -- 5. amax reduction group of weight shards on multi-dim meshes ---------------------------


def reset_parameters_needs_shard_alias() -> bool:
    """TE's reset_parameters asks a multi-dim param mesh for the dim named "shard"."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    fn = vars(TransformerEngineBaseModule)["reset_parameters"]
    return not getattr(fn, "_te_compat_patched", False) and 'mesh_dim="shard"' in inspect.getsource(
        fn
    )


@contextmanager
def shard_dim_alias(shard_dim: str):
    """Inside: a DeviceMesh without a "shard" dim answers get_group("shard") with `shard_dim`
    (our FSDP dim, e.g. "dp_shard"), so TE gives quantizers the weight-sharding group."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.get_group

    def get_group(self, mesh_dim=None):
        names = self.mesh_dim_names or ()
        if mesh_dim == "shard" and "shard" not in names and shard_dim in names:
            mesh_dim = shard_dim
        return original(self, mesh_dim)

    DeviceMesh.get_group = get_group
    try:
        yield
    finally:
        DeviceMesh.get_group = original


def ensure_shard_amax_group(shard_dim: str = "dp_shard") -> bool:
    """TE (2.20) gives current-scaling / NVFP4 weight quantizers of FSDP2 DTensor params the
    amax group of the mesh dim literally named "shard" when the mesh has 2+ dims (FSDP x TP,
    HSDP); ours is `shard_dim`, and the lookup raises. Wrap reset_parameters so that lookup
    resolves to `shard_dim`. True if patched (idempotent; no-op where TE does not need it)."""
    if not te_importable() or not reset_parameters_needs_shard_alias():
        return False
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    original = vars(TransformerEngineBaseModule)["reset_parameters"]

    def reset_parameters(self, *args, **kwargs):
        with shard_dim_alias(shard_dim):
            return original(self, *args, **kwargs)

    reset_parameters._te_compat_patched = True
    reset_parameters._te_compat_original = original
    reset_parameters.__doc__ = original.__doc__
    TransformerEngineBaseModule.reset_parameters = reset_parameters
    log.info("te_compat: reset_parameters resolves the amax mesh dim 'shard' to %r", shard_dim)
    return True


# -- 6. FusedAdam FP8 transpose cache; 7. DTensor `out` of fsdp_post_all_gather ------------


def fused_adam_resets_fp8_caches() -> bool:
    from transformer_engine.pytorch.optimizers import FusedAdam

    return "_reset_caches" in inspect.getsource(FusedAdam.step)


def reset_fp8_weight_caches(optimizer: torch.optim.Optimizer) -> int:
    """Mark the cached FP8 transposes of the optimizer's delayed-scaling Float8Tensor params
    stale (what an in-place update must do); they are rebuilt from the new bytes when next
    used. Returns how many params were marked."""
    count = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = local_tensor(p)
            quantizer = getattr(local, "_quantizer", None)
            if type(quantizer).__name__ == "Float8Quantizer" and hasattr(local, "_reset_caches"):
                local._reset_caches()
                count += 1
    return count


def ensure_fused_adam_fp8_cache_reset() -> bool:
    """Wrap FusedAdam.step so the FP8 params it rewrote in place drop their cached transposes,
    when TE's step does not do it itself. True if patched."""
    if not te_importable() or _PATCHED.get("fused_adam_fp8_cache"):
        return bool(_PATCHED.get("fused_adam_fp8_cache"))
    from transformer_engine.pytorch.optimizers import FusedAdam

    if fused_adam_resets_fp8_caches():
        return False
    original = FusedAdam.step

    def step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        reset_fp8_weight_caches(self)
        return out

    step.__wrapped__ = original
    FusedAdam.step = step
    _PATCHED["fused_adam_fp8_cache"] = True
    return True


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def ensure_post_all_gather_dtensor_out() -> list[str]:
    """Let every quantized tensor class's fsdp_post_all_gather take a DTensor `out` (a TP
    weight's unsharded parameter) by handing TE its local tensor, which is what TE updates.
    Returns the patched class names."""
    if not te_importable():
        return []
    import transformer_engine.pytorch  # noqa: F401  (defines every quantized tensor class)

    patched = []
    for cls in _subclasses(_quantized_tensor_cls()):
        fn = vars(cls).get("fsdp_post_all_gather")
        if fn is None or getattr(fn, "_te_compat_patched", False):
            continue
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = ""
        if "DTensor" in source or "_local_tensor" in source:
            continue

        cls.fsdp_post_all_gather = wrap_post_all_gather(fn)
        patched.append(cls.__name__)
    return patched


def wrap_post_all_gather(fn):
    """fsdp_post_all_gather that (1) takes a DTensor `out` by handing `fn` its local tensor and
    (2) gives `fn` each gathered buffer in the shape of `out` when they hold the same number of
    elements: torch views the gathered buffers with dim-0 semantics, (world * rows, cols /
    world) for a weight FSDP shards along dim 1 (fc1 under TP), although the bytes already are
    the row-major full tensor (torch's chunk-cat); TE would otherwise give the parameter that
    shape from the second all-gather on. Buffers of another size (scales) pass unchanged."""

    def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if isinstance(out, DTensor):
            out = out._local_tensor
        if out is not None:
            shape = out.shape
            all_gather_outputs = tuple(
                t.view(shape) if t.numel() == out.numel() and t.shape != shape else t
                for t in all_gather_outputs
            )
        return fn(self, all_gather_outputs, metadata, param_dtype, out=out)

    post_all_gather._te_compat_patched = True
    post_all_gather.__wrapped__ = fn
    return post_all_gather


# -- 8. FSDP2 with weights that all-gather several tensors (data + block scales) ----------


def fsdp_one_rank_drops_extra_inputs() -> bool:
    """Whether FSDP2's one-rank shard path hands only the first all-gather input of a tensor
    subclass to its fsdp_post_all_gather (see the module docstring)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        source = inspect.getsource(FSDPParamGroup.wait_for_unshard)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return "all_gather_inputs[0]" in source


def _one_rank(group) -> bool:
    """The condition of torch's one-rank path in wait_for_unshard: no shard group of more
    than one rank."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    if not isinstance(group.mesh_info, FSDPMeshInfo):
        return True
    return group._all_gather_process_group.size() == 1


def _multi_input(fsdp_param) -> bool:
    return hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")


def _copy_every_input(group) -> None:
    """The one-rank unshard done for every all-gather input of every multi-tensor parameter:
    each output is a copy of its input (this rank holds the whole weight). torch's path then
    copies the first input again and finds the outputs already sized."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import alloc_storage

    for fsdp_param in group.fsdp_params:
        if not _multi_input(fsdp_param):
            continue
        inputs = fsdp_param.all_gather_inputs
        if len(inputs) < 2:
            continue
        fsdp_param.init_all_gather_outputs(
            [t.numel() for t in inputs], [t.dtype for t in inputs], 1, group.device
        )
        for out, inp in zip(fsdp_param.all_gather_outputs, inputs):
            alloc_storage(out)
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(inp.reshape(-1))


def ensure_one_rank_keeps_all_inputs() -> bool:
    """Patch FSDP2's one-rank unshard so a multi-tensor weight gets all its inputs, where
    torch drops them (fsdp_one_rank_drops_extra_inputs). True if patched."""
    if not fsdp_one_rank_drops_extra_inputs():
        return False
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig = FSDPParamGroup.wait_for_unshard
    if getattr(orig, "_te_compat_patched", False):
        return True

    def wait_for_unshard(self):
        if self._all_gather_result and _one_rank(self):
            _copy_every_input(self)
        return orig(self)

    wait_for_unshard._te_compat_patched = True
    wait_for_unshard.__wrapped__ = orig
    FSDPParamGroup.wait_for_unshard = wait_for_unshard
    _PATCHED["one_rank_inputs"] = True
    return True


#: Tensor classes whose dim-1 shards this module regroups: class -> fn(sharded tensor) ->
#: (columns per scale block, multiple the scale columns are padded to).
_DIM1_BLOCK_LAYOUT: dict[type, Any] = {}


def regroup_dim1_blocks(data, scale, world: int, block: int, pad: int):
    """Turn all-gathered dim-1 shards of a row-wise block-scaled weight into the full weight.

    data: (world * R, c), the shards' (R, c) data one after the other (dim-0 order); scale:
    (world * S, p), their (S, p) scales, p = c / block rounded up to `pad`. Returns the full
    (R, world * c) data and (S, world * c / block rounded up to pad) scales (padding zero),
    written over the same buffers (views of them), so FSDP2 frees them as usual. c must be a
    multiple of `block` (each shard holds whole blocks); the config check ensures it.
    """
    rows, cols = data.shape[0] // world, data.shape[1]
    if cols % block:
        raise ValueError(f"shard width {cols} is not a multiple of the scale block {block}")
    srows, sp = scale.shape[0] // world, scale.shape[1]
    blocks = cols // block
    full_sp = -(-world * blocks // pad) * pad
    shards = data.clone().view(world, rows, cols)
    full = data.view(-1).view(rows, world * cols)
    full.view(rows, world, cols).copy_(shards.transpose(0, 1))
    scale_shards = scale.clone().view(world, srows, sp)[:, :, :blocks]
    full_scale = scale.view(-1)[: srows * full_sp].view(srows, full_sp)
    full_scale[:, world * blocks :].zero_()
    full_scale[:, : world * blocks].view(srows, world, blocks).copy_(scale_shards.transpose(0, 1))
    return full, full_scale


def _dim1_params(fsdp_params):
    for fsdp_param in fsdp_params:
        if fsdp_param.fsdp_placement.dim == 0 or not _multi_input(fsdp_param):
            continue
        if type(fsdp_param._sharded_local_tensor) in _DIM1_BLOCK_LAYOUT:
            yield fsdp_param


def wrap_dim1_copy_out(copy_out):
    """FSDP2's all-gather copy-out that leaves registered block-scaled weights sharded along
    dim 1 in dim-0 order (torch's chunk-cat would view the scales in the weight's shape) and
    tells their fsdp_post_all_gather to regroup them."""

    def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
        from torch.distributed.tensor import Shard

        swapped = []
        for fsdp_param in _dim1_params(fsdp_params):
            swapped.append((fsdp_param, fsdp_param.fsdp_placement))
            fsdp_param.fsdp_placement = Shard(0)
            fsdp_param._sharded_local_tensor._te_compat_gathered_world = group.size()
        try:
            return copy_out(all_gather_result, fsdp_params, group)
        finally:
            for fsdp_param, placement in swapped:
                fsdp_param.fsdp_placement = placement

    foreach_all_gather_copy_out._te_compat_patched = True
    foreach_all_gather_copy_out.__wrapped__ = copy_out
    return foreach_all_gather_copy_out


def wrap_dim1_post_all_gather(fn, layout):
    """fsdp_post_all_gather that first regroups dim-1 shards gathered in dim-0 order."""

    def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        world = vars(self).pop("_te_compat_gathered_world", None)
        if world is None or world == 1:
            return fn(self, all_gather_outputs, metadata, param_dtype, out=out)
        block, pad = layout(self)
        data, scale = regroup_dim1_blocks(*all_gather_outputs[:2], world, block, pad)
        result = fn(self, (data, scale, *all_gather_outputs[2:]), metadata, param_dtype, out=out)
        if out is not None:
            return result
        # FSDP2 frees and re-allocates the returned inner tensors' storage around each
        # all-gather, to their own size: hand back the whole buffers, not the regrouped views
        # (the full scales are shorter than the gathered ones, and would shrink the buffer).
        return result[0], tuple(all_gather_outputs)

    post_all_gather._te_compat_patched = True
    post_all_gather.__wrapped__ = fn
    return post_all_gather


def fsdp_dim1_needs_regroup() -> bool:
    """Whether FSDP2's copy-out views every all-gather output of a dim-1-sharded parameter in
    the parameter's shard shape (so scales of another size cannot pass)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        source = inspect.getsource(_fsdp_collectives.foreach_all_gather_copy_out)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return "fsdp_placement.dim != 0" in source and "padded_sharded" in source


def enable_dim1_block_gather(cls: type, layout) -> bool:
    """Let FSDP2 shard `cls` weights along dim 1: its copy-out is wrapped once (process-wide),
    `cls.fsdp_post_all_gather` regroups. layout(tensor) -> (block, pad) as in
    regroup_dim1_blocks. True if enabled (False: this torch needs no regrouping)."""
    if not fsdp_dim1_needs_regroup():
        return False
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    current = _fsdp_param_group.foreach_all_gather_copy_out
    if not getattr(current, "_te_compat_patched", False):
        _fsdp_param_group.foreach_all_gather_copy_out = wrap_dim1_copy_out(current)
    if cls not in _DIM1_BLOCK_LAYOUT:
        cls.fsdp_post_all_gather = wrap_dim1_post_all_gather(cls.fsdp_post_all_gather, layout)
        _DIM1_BLOCK_LAYOUT[cls] = layout
    return True


def _block_layout(tensor) -> tuple[int, int]:
    # Float8BlockwiseQTensor with 128x128 blocks: rowwise scales (ceil(rows / 128), ceil(cols
    # / 128) padded to a multiple of 4), TE's Float8BlockQuantizer.get_scale_shape.
    return tensor._quantizer.block_len, 4


def ensure_dim1_block_gather() -> bool:
    """FP8 128x128-block weights sharded by FSDP2 along dim 1 (fc1 under TP)."""
    if not te_importable():
        return False
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockwiseQTensor,
    )

    return enable_dim1_block_gather(Float8BlockwiseQTensor, _block_layout)


def apply_all(shard_dim: str = "dp_shard") -> dict[str, Any]:
    """Apply every process-wide fix (idempotent); the per-model ones run inside the
    checkpoint Statefuls. Returns what was patched, for logging."""
    return {
        "untyped_storage": ensure_quantized_tensor_storage(),
        "shard_amax_group": ensure_shard_amax_group(shard_dim),
        "fused_adam_fp8_cache": ensure_fused_adam_fp8_cache_reset(),
        "post_all_gather_dtensor_out": ensure_post_all_gather_dtensor_out(),
        "one_rank_inputs": ensure_one_rank_keeps_all_inputs(),
        "dim1_block_gather": ensure_dim1_block_gather(),
    }
