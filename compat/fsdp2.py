"""Two torch FSDP2 gaps for parameters that all-gather more than one tensor (TE's block-scaled
FP8, MXFP8 and NVFP4 weights: data + scales), filled until torch ships its own fix.

| gap | upstream | detect | fix | test |
| --- | --- | --- | --- | --- |
| one-rank shard mesh (dp_shard = 1 on several processes: ddp, tp, hsdp_tp 2x1x2): `FSDPParamGroup.wait_for_unshard` skips the all-gather and hands only the first all-gather input to `fsdp_post_all_gather` (TE: `ValueError: not enough values to unpack`) | pytorch/pytorch PR 197999 (open) | `one_rank_drops_extra_inputs` | `ensure_one_rank_keeps_all_inputs` | tests/test_compat_fsdp2.py |
| weight sharded along dim 1 (fc1 under tensor parallelism, parallel/tp.py): the copy-out chunk-cats every output viewed in the weight's shard shape, which scales do not have (`shape '[3072, 256]' is invalid for input of size 96`) | none filed; the chunk-cat copy-out came with pytorch/pytorch PR 137496 (`shard_placement_fn`) | `dim1_copy_out_views_every_output` | `enable_dim1_block_gather` + `regroup_dim1_blocks` (FP8 128x128 blocks; compat/te.py registers them) | tests/test_compat_fsdp2.py |

Detection. Both gaps sit inside FSDP2 functions that only run with a process group and a real
FSDP2 unit, which a training process cannot build for itself before its own model exists, so
the detectors read the *structure* of torch's functions (their syntax tree: a subscript
`all_gather_inputs[0]` in the one-rank branch; a `fsdp_placement.dim != 0` branch that views
outputs in the padded shard shape), which no reformatting changes. The tests run the real
behaviour on gloo and assert both ways: torch alone fails while the detector reports the gap,
and the fix makes FSDP2's gathered weight equal the one-process weight. When torch fixes a
gap, that test fails first, which is the signal to retire the fix. If a function the detector
reads has moved, it says so in a warning instead of guessing.

Nothing here imports TransformerEngine; the dim-1 regrouping is told each tensor class's scale
layout by its caller.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Tensor classes whose dim-1 shards are regrouped: class -> fn(sharded tensor) -> (columns per
#: scale block, multiple the scale columns are padded to).
_DIM1_BLOCK_LAYOUT: dict[type, Callable[[Any], tuple[int, int]]] = {}


def _syntax_tree(fn) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


def _attr_chain(node: ast.AST) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"] (innermost name first); [] for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _warn_unknown(what: str) -> None:
    log.warning(
        "compat.fsdp2: cannot read %s in this torch; its gap is assumed fixed and our fix is "
        "not applied (run tests/test_compat_fsdp2.py to check)",
        what,
    )


# -- gap 1: the one-rank path keeps only the first all-gather input -------------------------


def one_rank_drops_extra_inputs() -> bool:
    """Whether FSDP2's one-rank unshard (`FSDPParamGroup.wait_for_unshard`) reads only
    `all_gather_inputs[0]` of each parameter."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        _warn_unknown("FSDPParamGroup")
        return False
    tree = _syntax_tree(FSDPParamGroup.wait_for_unshard)
    if tree is None:
        _warn_unknown("FSDPParamGroup.wait_for_unshard")
        return False
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and _attr_chain(node.value)[-1:] == ["all_gather_inputs"]
            and isinstance(node.slice, ast.Constant)
            and node.slice.value == 0
        ):
            return True
    return False


def _one_rank(group) -> bool:
    """The condition of torch's one-rank path: no shard group of more than one rank."""
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
    """Wrap FSDP2's one-rank unshard so a multi-tensor weight gets all its inputs, where torch
    drops them. True if the wrapper is installed (now or before)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    current = FSDPParamGroup.wait_for_unshard
    if getattr(current, "_compat_patched", False):
        return True
    if not one_rank_drops_extra_inputs():
        return False

    def wait_for_unshard(self):
        if self._all_gather_result and _one_rank(self):
            _copy_every_input(self)
        return current(self)

    wait_for_unshard._compat_patched = True
    wait_for_unshard.__wrapped__ = current
    FSDPParamGroup.wait_for_unshard = wait_for_unshard
    return True


# -- gap 2: dim-1 sharding views every output in the weight's shard shape -------------------


def dim1_copy_out_views_every_output() -> bool:
    """Whether FSDP2's all-gather copy-out has a branch for `fsdp_placement.dim != 0` that
    chunk-cats outputs viewed in the padded shard shape (scales of another size cannot pass)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    except ImportError:
        _warn_unknown("torch.distributed.fsdp._fully_shard._fsdp_collectives")
        return False
    fn = getattr(_fsdp_collectives, "foreach_all_gather_copy_out", None)
    tree = _syntax_tree(fn) if fn is not None else None
    if tree is None:
        _warn_unknown("foreach_all_gather_copy_out")
        return False
    dim_branch = padded_view = False
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Compare)
            and _attr_chain(node.left)[-2:] == ["fsdp_placement", "dim"]
            and isinstance(node.ops[0], ast.NotEq)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value == 0
        ):
            dim_branch = True
        if isinstance(node, ast.Attribute | ast.Name):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            padded_view |= "padded_sharded" in name
    return dim_branch and padded_view


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
            fsdp_param._sharded_local_tensor._compat_gathered_world = group.size()
        try:
            return copy_out(all_gather_result, fsdp_params, group)
        finally:
            for fsdp_param, placement in swapped:
                fsdp_param.fsdp_placement = placement

    foreach_all_gather_copy_out._compat_patched = True
    foreach_all_gather_copy_out.__wrapped__ = copy_out
    return foreach_all_gather_copy_out


def wrap_dim1_post_all_gather(fn, layout):
    """fsdp_post_all_gather that first regroups dim-1 shards gathered in dim-0 order."""

    def post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        world = vars(self).pop("_compat_gathered_world", None)
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

    post_all_gather._compat_patched = True
    post_all_gather.__wrapped__ = fn
    return post_all_gather


def enable_dim1_block_gather(cls: type, layout: Callable[[Any], tuple[int, int]]) -> bool:
    """Let FSDP2 shard `cls` weights along dim 1: its copy-out is wrapped once (process-wide),
    `cls.fsdp_post_all_gather` regroups. layout(tensor) -> (block, pad) as in
    regroup_dim1_blocks. True if enabled (False: this torch needs no regrouping)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    current = _fsdp_param_group.foreach_all_gather_copy_out
    if not getattr(current, "_compat_patched", False):
        if not dim1_copy_out_views_every_output():
            return False
        _fsdp_param_group.foreach_all_gather_copy_out = wrap_dim1_copy_out(current)
    if cls not in _DIM1_BLOCK_LAYOUT:
        cls.fsdp_post_all_gather = wrap_dim1_post_all_gather(cls.fsdp_post_all_gather, layout)
        _DIM1_BLOCK_LAYOUT[cls] = layout
    return True
