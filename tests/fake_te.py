"""A trainable TE-shaped model and FusedAdam on CPU, for the recipe-switch tests.

tests/test_recipes.py's fakes check single calls; these train: `FakeTEModel` has TE's module
attributes (`quantizers["scaling_fwd"]`, `param_init_meta[name].fp8_meta_index`,
`primary_weights_in_fp8`, TE 2.20.2 module/base.py:906-911) under the parameter names of the
real model (`layers.<i>.self_attention.proj.weight`, ...), so `Recipe.prepare_weights`,
`recipes/quantized.py` and `checkpoint/precision.py` run on it unchanged. Each recipe's weight
quantizer has the TE class name of that recipe (recipe.WEIGHT_TYPES) and a lossy cast of its
own (per-tensor or per-row scaled float8, or bf16), so a weight cast by one recipe differs
from the same weight cast by another. `FakeFusedAdam` keeps TE FusedAdam's master-weight
contract (optimizers/fused_adam.py in TE 2.20.2): with `master_weights`, every parameter gets an
fp32 `master_param`; the step updates a quantized parameter's master and re-casts the parameter
from it (`quantize_(master)`), and updates an fp32 parameter in place, leaving its master at
its initial copy; the step count lives in each param group. The real classes are exercised by
tests/gpu/test_recipe_switch_gpu.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from recipes import Recipe
from recipes.amax import local_tensor

DIM, VOCAB = 16, 32


def _per_tensor_fp8(x: torch.Tensor) -> torch.Tensor:
    scale = 448.0 / x.abs().max().clamp(min=1e-12)
    return (x * scale).to(torch.float8_e4m3fn).float() / scale


def _per_row_fp8(x: torch.Tensor) -> torch.Tensor:
    scale = 448.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return (x * scale).to(torch.float8_e4m3fn).float() / scale


def _coarse(x: torch.Tensor) -> torch.Tensor:  # a 4-bit-like grid per row
    scale = 6.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return torch.round(x * scale * 2) / 2 / scale


class _FakeQuantizer:
    cast = staticmethod(_per_tensor_fp8)
    tensor_class: type

    def __init__(self):
        self.rowwise_usage = self.columnwise_usage = None
        self.internal = True

    def set_usage(self, *, rowwise=None, columnwise=None):
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise

    def __call__(self, tensor: torch.Tensor):
        return self.tensor_class(self.cast(tensor.detach().float()), self)


class FakeQuantizedTensor(torch.Tensor):
    """TE QuantizedTensor's surface: `_quantizer`, `dequantize()`, `quantize_(src)`. Holds the
    dequantized values; saved (torch.save, DCP) as a plain tensor of them."""

    amax_reduction_group = None  # class attribute, as on Float8Tensor / NVFP4Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # ops give plain tensors

    @staticmethod
    def __new__(cls, data, quantizer):
        t = torch.Tensor._make_subclass(cls, data.as_subclass(torch.Tensor).detach())
        t._quantizer = quantizer
        return t

    def __init__(self, data, quantizer):
        pass

    def detach(self):  # TE's QuantizedTensor.detach keeps the quantizer (make_like)
        return type(self)(self, self._quantizer)

    def dequantize(self):
        return self.as_subclass(torch.Tensor).clone()

    @torch.no_grad()
    def quantize_(self, src):
        self.as_subclass(torch.Tensor).copy_(self._quantizer.cast(src.float()))
        return self

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).clone().__reduce_ex__(protocol)


class FakeFloat8Tensor(FakeQuantizedTensor):
    pass


class FakeBlockTensor(FakeQuantizedTensor):
    _rowwise_scale_inv = None  # block-scaled: requantize_from_masters rebuilds it after a load


def _quantizer_class(name: str, cast, tensor_class, amax: bool):
    def init(self):
        _FakeQuantizer.__init__(self)
        if amax:
            self.with_amax_reduction = False
            self.amax_reduction_group = None

    return type(
        name,
        (_FakeQuantizer,),
        {"__init__": init, "cast": staticmethod(cast), "tensor_class": tensor_class},
    )


#: recipe name -> weight quantizer class, named as TE's (recipes.WEIGHT_TYPES).
QUANTIZERS = {
    "fp8_delayed": _quantizer_class("Float8Quantizer", _per_tensor_fp8, FakeFloat8Tensor, False),
    "fp8_cs": _quantizer_class(
        "Float8CurrentScalingQuantizer", _per_tensor_fp8, FakeFloat8Tensor, True
    ),
    "fp8_block": _quantizer_class("Float8BlockQuantizer", _per_row_fp8, FakeBlockTensor, False),
    "mxfp8": _quantizer_class("MXFP8Quantizer", _per_row_fp8, FakeBlockTensor, False),
    "nvfp4": _quantizer_class("NVFP4Quantizer", _coarse, FakeBlockTensor, True),
}


class FakeTELinear(torch.nn.Module):
    """A TE module with one GEMM: `weight` at TE's GEMM1_WEIGHT slot (fp8_meta_index 1)."""

    def __init__(self, recipe: Recipe, layer: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(DIM, DIM))
        self.param_init_meta = {"weight": SimpleNamespace(fp8_meta_index=1)}
        make = QUANTIZERS.get(recipe.name)
        self.quantizers = {
            "scaling_fwd": [make() for _ in range(3)] if make is not None else [],
            "scaling_bwd": [],
        }
        self.primary_weights_in_fp8 = recipe.quantized_init and not recipe.is_bf16_layer(layer)
        self.quantized_compute = recipe.is_quantized and not recipe.is_bf16_layer(layer)

    def forward(self, x):
        w = self.weight
        if isinstance(w, DTensor):  # sharded like FSDP: gathered for the GEMM
            w = w.full_tensor()
        if self.quantized_compute and not isinstance(w, FakeQuantizedTensor):
            # TE casts a high-precision weight at each forward (straight-through gradient).
            q = self.quantizers["scaling_fwd"][1].cast(w.detach())
            w = w + (q - w).detach()
        return F.linear(x, w)


class FakeTEModel(torch.nn.Module):
    """embed -> n blocks (attention proj + MLP fc2 stand-ins, each a FakeTELinear under the
    real model's names) -> norm -> head."""

    def __init__(self, recipe: Recipe, n_layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList()
        for i in range(n_layers):
            block = torch.nn.Module()
            block.self_attention = torch.nn.Module()
            block.self_attention.proj = FakeTELinear(recipe, i)
            block.layernorm_mlp = torch.nn.Module()
            block.layernorm_mlp.fc2 = FakeTELinear(recipe, i)
            self.layers.append(block)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, labels):
        table = self.embed.weight
        h = F.embedding(tokens, table.full_tensor() if isinstance(table, DTensor) else table)
        for block in self.layers:
            h = h + torch.tanh(block.self_attention.proj(h))
            h = h + torch.tanh(block.layernorm_mlp.fc2(h))
        head = self.head.weight
        logits = F.linear(self.norm(h), head.full_tensor() if isinstance(head, DTensor) else head)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def init_fake(model: torch.nn.Module, seed: int) -> None:
    """Weights from the seed, per parameter name (model/init.py's rule, simplified)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
            full = torch.randn(p.shape, generator=g) * 0.3
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
            local_tensor(p).copy_(full)


class FakeFusedAdam(torch.optim.Optimizer):
    """AdamW with TE FusedAdam's master-weight contract (see the module docstring)."""

    def __init__(
        self,
        params,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        *,
        master_weights=False,
        master_weight_dtype=torch.float32,
        store_param_remainders=False,
        capturable=False,
    ):
        super().__init__(
            params,
            {
                "lr": lr,
                "bias_correction": True,
                "betas": betas,
                "eps": eps,
                "weight_decay": weight_decay,
            },
        )
        self.master_weights = master_weights

    @torch.no_grad()
    def initialize_state(self, param, store_param_remainders):
        local = local_tensor(param)
        value = local.dequantize() if isinstance(local, FakeQuantizedTensor) else local.detach()
        self.state[param]["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        if self.master_weights:
            master = torch.zeros_like(param, dtype=torch.float32)
            local_tensor(master).copy_(value.float())
            self.state[param]["master_param"] = master

    @torch.no_grad()
    def set_scaled_state(self, param, name, value):
        assert value.dtype == torch.float32
        if name not in self.state[param]:
            self.state[param][name] = torch.zeros_like(param, dtype=torch.float32)
        local_tensor(self.state[param][name]).copy_(local_tensor(value))

    def get_unscaled_state(self, param, name):
        return self.state[param][name]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if len(self.state[p]) == 0:
                    self.initialize_state(p, False)
                st = self.state[p]
                local = local_tensor(p)
                grad = local_tensor(p.grad).float()
                quantized = isinstance(local, FakeQuantizedTensor)
                value = local_tensor(st["master_param"]) if quantized else local
                m, v = local_tensor(st["exp_avg"]), local_tensor(st["exp_avg_sq"])
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt().add_(group["eps"])
                target = value.as_subclass(torch.Tensor) if quantized else value
                target.mul_(1 - group["lr"] * group["weight_decay"])
                target.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))
                if quantized:
                    local.quantize_(value)
        return None


def build_fake(rcfg, seed: int = 0, n_layers: int = 2, shard=None):
    """(recipe, model, optimizer) as train.build_training makes them, for the fake model.
    shard: a 1-D DeviceMesh to shard the embedding and the head over (dim 0), as FSDP would
    (the TE weights stay whole on every rank: a DTensor of a fake quantized tensor would need
    TE's __torch_dispatch__)."""
    from recipes import build_recipe

    recipe = build_recipe(rcfg, n_layers)
    model = FakeTEModel(recipe, n_layers)
    if shard is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        for module in (model.embed, model.head):
            dt = distribute_tensor(module.weight.detach(), shard, [Shard(0)])
            module.weight = torch.nn.Parameter(dt)
    init_fake(model, seed)
    recipe.prepare_weights(model, None, None)
    optimizer = FakeFusedAdam(model.parameters(), **recipe.fused_adam_kwargs())
    recipe.attach_optimizer(model, optimizer, None)
    return recipe, model, optimizer


def batch(step: int, n: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def high_precision(model, optimizer) -> dict[str, torch.Tensor]:
    """Each parameter's high-precision value: a quantized one's master, else itself."""
    out = {}
    for name, p in model.named_parameters():
        local = local_tensor(p)
        if isinstance(local, FakeQuantizedTensor):
            value = optimizer.state[p]["master_param"]
        else:
            value = p
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = value.detach().as_subclass(torch.Tensor).clone()
    return out


def moments(model, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            value = optimizer.state[p][k]
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{name}.{k}"] = value.clone()
    return out


def weights(model) -> dict[str, torch.Tensor]:
    """The parameters as the forward sees them (quantized ones dequantized)."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach().as_subclass(torch.Tensor).clone()
    return out
