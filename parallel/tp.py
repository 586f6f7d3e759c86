"""Tensor parallelism: placements shared by both implementations, and the reference plan.

Placements on the tp mesh (identical for model/llama.py and model/te_llama.py, so a
checkpoint saved by one loads into the other):

    embed.weight, lm_head.weight                  Shard(0)   vocab-parallel
    *.layernorm_qkv.weight                        Shard(0)   column-parallel (KV groups)
    *.fc1_weight                                  _StridedShard(0, split_factor=2)
    *.proj.weight, *.fc2_weight                   Shard(1)   row-parallel
    *norm weights                                 Replicate

The fused QKV weight's rows are KV groups, each [its query heads; key; value] (model/llama.py),
so Shard(0) hands rank r the contiguous groups [r*G/tp, (r+1)*G/tp): exactly the heads TE's
column-parallel QKV computes on rank r (tp divides n_kv_heads, parallel/dims.py checks it).

fc1 holds [gate; up] over the full ffn_dim. A rank must compute a matching slice of both
halves, so its local rows are [gate_r; up_r]. Plain Shard(0) would hand rank 0 the first
2*ffn/tp rows (all gate when tp=2) and make the global layout depend on tp.
_StridedShard(0, split_factor=2) says exactly "split into the 2 halves, shard each over tp,
concatenate": the global tensor stays [gate; up] for every tp.

How the forward runs: every module keeps DTensor parameters (what FSDP2, the optimizer and
DCP see); forward hooks swap them for their local tensors for the duration of the module's
forward (`use_local_weights`), so the module code does plain tensor math on its shard, and
`to_local`'s backward turns the local gradient back into a DTensor gradient of the
parameter. The communication around the modules is explicit (Megatron's f/g functions):

    reference (no sequence parallel)       TE (TE does the block-internal communication)
    x -> copy_to_tp -> norm+QKV (local heads) -> attention -> proj -> reduce_from_tp
    x -> copy_to_tp -> norm+fc1 -> SwiGLU -> fc2 -> reduce_from_tp
    embedding: masked local lookup + reduce (or reduce-scatter over the sequence with SP)
    final norm -> copy_to_tp (or all-gather the sequence with SP) -> head (local vocab)
    logits: all-gather over the vocabulary -> full logits, a plain tensor

Norm weights inside a column-parallel module (norm fused with QKV/fc1) see the input before
`copy_to_tp`, so their local gradient is a partial sum over tp ranks: their local view is
taken with grad placement Partial, and FSDP2 reduces it to the Replicate parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# ---------------------------------------------------------------------------------------------
# Collectives with the gradients Megatron-style tensor parallelism needs. Each one works on
# gloo (CPU tests) and NCCL; gloo has no reduce-scatter or all_gather_into_tensor.


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if _is_gloo(group):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)
    # Gathering along dim 0 of the moved tensor is concatenation along `dim`.
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if _is_gloo(group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y.chunk(world, dim=dim)[rank].contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Enter a column-parallel region: identity forward, all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Leave a row-parallel region: all-reduce partial sums; the gradient is replicated."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _DimCollective(torch.autograd.Function):
    """A collective along `dim` whose backward is another one: forward(x, dim, group) and
    backward(grad, dim, group) are two of _all_gather / _split / _reduce_scatter."""

    @staticmethod
    def forward(ctx, x, dim, group, forward, backward):
        ctx.dim, ctx.group, ctx.backward = dim, group, backward
        return forward(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward(g, ctx.dim, ctx.group), None, None, None, None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, dim, group):
    """All-gather along `dim`; backward keeps this rank's slice of the replicated gradient."""
    return _DimCollective.apply(x, dim, group, _all_gather, _split)


def reduce_scatter_to_sp(x, dim, group):
    """Row-parallel output into a sequence-parallel region: reduce-scatter along `dim`."""
    return _DimCollective.apply(x, dim, group, _reduce_scatter, _all_gather)


def gather_from_sp(x, dim, group):
    """Sequence-parallel region into a column-parallel one: all-gather along `dim`; the
    gradient is a partial sum per rank, so backward reduce-scatters it."""
    return _DimCollective.apply(x, dim, group, _all_gather, _reduce_scatter)


# ---------------------------------------------------------------------------------------------
# Placements and DTensor parameters.

COLUMN = Shard(0)
ROW = Shard(1)
FC1 = _StridedShard(0, split_factor=2)
REPLICATE = Replicate()


def placement_for(name: str) -> Placement:
    """tp placement of a parameter, from its (canonical) name; the table in the docstring."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("layernorm_qkv.weight"):
        return COLUMN
    if leaf == "fc1_weight":
        return FC1
    if leaf == "fc2_weight" or name.endswith("proj.weight"):
        return ROW
    if name in ("embed.weight", "lm_head.weight"):
        return COLUMN
    if "norm" in leaf or name.endswith("norm.weight"):
        return REPLICATE
    raise ValueError(f"no tensor-parallel placement for parameter {name!r}")


def _global_shape(local_shape, placement: Placement, tp: int) -> tuple[int, ...]:
    shape = list(local_shape)
    if isinstance(placement, (Shard, _StridedShard)):
        shape[placement.dim] *= tp
    return tuple(shape)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def distribute_param(param: nn.Parameter, mesh, placement: Placement) -> nn.Parameter:
    """A global (reference) parameter -> DTensor parameter holding this rank's part."""
    if param.is_meta:
        tp = mesh.size()
        shape = list(param.shape)
        if isinstance(placement, (Shard, _StridedShard)):
            if shape[placement.dim] % tp:
                raise ValueError(
                    f"dim {placement.dim} of {tuple(shape)} is not divisible by tp={tp}"
                )
            shape[placement.dim] //= tp
        local = torch.empty(shape, dtype=param.dtype, device="meta")
        dt = DTensor.from_local(
            local, mesh, [placement], run_check=False, shape=param.shape, stride=param.stride()
        )
    else:
        dt = distribute_tensor(param.detach(), mesh, [placement])
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def local_to_dtensor_param(param: nn.Parameter, mesh, placement: Placement) -> nn.Parameter:
    """A parameter that already holds this rank's part (TE's TP modules) -> DTensor parameter
    with the global shape."""
    shape = _global_shape(param.shape, placement, mesh.size())
    dt = DTensor.from_local(
        param.detach(),
        mesh,
        [placement],
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def fsdp_shard_placement(param) -> Shard | None:
    """FSDP2 shard_placement_fn. fc1 under TP is sharded by FSDP along dim 1: its tp-local
    rows [gate_r; up_r] are two separate row blocks of the global tensor, and chunking them
    again along dim 0 gives pieces no DTensor placement describes (full_tensor, distribute_tensor
    and DCP would all misplace rows). Along dim 1 the two shardings are independent."""
    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) for p in param.placements):
        return Shard(1)
    return None


def fsdp_shard_extents(
    shapes: dict[str, tuple[str, tuple[int, int]]], dp_shard: int, tp: int
) -> dict[str, tuple[str, int, int]]:
    """Per quantizable weight of a block (`shapes`: model/config.py's `block_weight_shapes`):
    (the dim FSDP shards, as "rows" or "columns"; that dim's tp-local size; the FSDP shard
    size), from the placements above (`placement_for`) and FSDP's shard placement
    (`fsdp_shard_placement`)."""
    out = {}
    for short, (name, shape) in shapes.items():
        placement = placement_for(f"layers.0.{name}")
        local = list(shape)
        if isinstance(placement, (Shard, _StridedShard)):
            local[placement.dim] //= tp
        dim = 1 if tp > 1 and isinstance(placement, _StridedShard) else 0
        out[short] = (("rows", "columns")[dim], local[dim], -(-local[dim] // dp_shard))
    return out


# ---------------------------------------------------------------------------------------------
# Forward with local tensors.


def use_local_weights(module: nn.Module, grad_placements: dict[str, Placement] | None = None):
    """For the duration of `module`'s forward, its DTensor parameters are replaced by their
    local tensors (differentiable: gradients flow back as DTensor gradients). Registered
    before fully_shard, so FSDP2's pre-forward all-gather runs first (it prepends its hook)
    and its post-forward reshard runs after the parameters are restored."""
    grad_placements = grad_placements or {}
    stack: list[dict[str, nn.Parameter]] = []

    def pre(mod, args):
        saved = {}
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                saved[name] = p
                gp = grad_placements.get(name)
                # Written into _parameters directly: a plain local tensor is not a Parameter.
                mod._parameters[name] = p.to_local(grad_placements=None if gp is None else [gp])
        stack.append(saved)

    def post(mod, args, out):
        for name, p in stack.pop().items():
            mod._parameters[name] = p
        return out

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def vocab_parallel_embedding(embed: nn.Embedding, group, *, sequence_dim: int | None = None):
    """Embedding with rows sharded over tp: each rank looks up the tokens in its vocabulary
    range (zeros elsewhere) and the partial results are summed, or reduce-scattered along
    `sequence_dim` into the sequence-parallel layout."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    stack: list[torch.Tensor] = []

    def pre(mod, args):
        (tokens,) = args
        rows = mod.num_embeddings // tp
        local = tokens - rank * rows
        outside = (local < 0) | (local >= rows)
        stack.append(outside)
        return (local.masked_fill(outside, 0),)

    def post(mod, args, out):
        out = out.masked_fill(stack.pop().unsqueeze(-1), 0.0)
        if sequence_dim is None:
            return reduce_from_tp(out, group)
        return reduce_scatter_to_sp(out, sequence_dim, group)

    embed.register_forward_pre_hook(pre)
    embed.register_forward_hook(post)


def head_weight_local(model: nn.Module, group):
    """The output head (lm_head.weight, or embed.weight when tied) is read by the model's own
    forward, not by a module call, so its local view is installed for the whole root forward.
    Logits (a forward without labels) are vocab-parallel and all-gathered into full logits (a
    plain tensor); with labels the model computes the loss from the local rows itself
    (vocab-parallel cross entropy over `model.head_tp_group`, model/loss.py), so no logits are
    ever gathered."""
    owner = model.embed if getattr(model, "lm_head", None) is None else model.lm_head
    model.head_tp_group = group
    stack: list[nn.Parameter] = []

    def pre(mod, args, kwargs):
        p = owner._parameters["weight"]
        stack.append(p)
        owner._parameters["weight"] = p.to_local()

    def post(mod, args, kwargs, out):
        owner._parameters["weight"] = stack.pop()
        return out if out.ndim == 0 else gather_from_tp(out, -1, group)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True, always_call=False)


def column_input(module: nn.Module, group):
    module.register_forward_pre_hook(lambda mod, args: (copy_to_tp(args[0], group), *args[1:]))


def row_output(module: nn.Module, group):
    module.register_forward_hook(lambda mod, args, out: reduce_from_tp(out, group))


def column_output_input(module: nn.Module, group, *, sequence_dim: int | None = None):
    """The output of `module` feeds a column-parallel consumer (the head): mark the copy, or
    all-gather the sequence-parallel shards."""
    if sequence_dim is None:
        module.register_forward_hook(lambda mod, args, out: copy_to_tp(out, group))
    else:
        module.register_forward_hook(
            lambda mod, args, out: gather_from_sp(out, sequence_dim, group)
        )


# ---------------------------------------------------------------------------------------------
# The reference plan.


def _distribute_module_params(module: nn.Module, mesh, prefix: str) -> None:
    for name, p in list(module.named_parameters(recurse=False)):
        full = f"{prefix}.{name}" if prefix else name
        module._parameters[name] = distribute_param(p, mesh, placement_for(full))


def apply_reference_tp(model: nn.Module, tp_mesh) -> None:
    """Tensor parallel for model/llama.py (no sequence parallelism: activations between the
    blocks are replicated over the tp ranks)."""
    group = tp_mesh.get_group()
    partial = {"layer_norm_weight": Partial()}
    _distribute_module_params(model.embed, tp_mesh, "embed")
    vocab_parallel_embedding(model.embed, group)
    for i, block in enumerate(model.layers):
        attn, mlp = block.self_attention, block.layernorm_mlp
        for mod, path in (
            (attn.layernorm_qkv, "self_attention.layernorm_qkv"),
            (attn.proj, "self_attention.proj"),
            (mlp, "layernorm_mlp"),
        ):
            _distribute_module_params(mod, tp_mesh, f"layers.{i}.{path}")
        column_input(attn.layernorm_qkv, group)
        use_local_weights(attn.layernorm_qkv, partial)
        use_local_weights(attn.proj)
        row_output(attn.proj, group)
        column_input(mlp, group)
        use_local_weights(mlp, partial)
        row_output(mlp, group)
    _distribute_module_params(model.norm, tp_mesh, "norm")
    use_local_weights(model.norm)
    column_output_input(model.norm, group)
    if model.lm_head is not None:
        _distribute_module_params(model.lm_head, tp_mesh, "lm_head")
    # The embedding's own hook handles its lookup; when tied the root hook has already
    # installed the local view, and use_local_weights skips non-DTensor entries.
    use_local_weights(model.embed)
    head_weight_local(model, group)
