"""Checkpoints portable across precision recipes (docs/RECIPE_SWITCH.md).

A checkpoint saved under one recipe loads under another (an accepted change of `recipe.*`, or
a `recipe.switch` step): bf16, fp8_delayed, fp8_cs, fp8_block, mxfp8, nvfp4, with or without
`quantized_init`, with other `bf16_layers`. What carries over, per kind of state:

| state | carried over |
| --- | --- |
| high-precision weights | exactly: a quantized parameter's fp32 FusedAdam master, else the parameter itself |
| optimizer moments, step counts | exactly (the same optimizer on both sides) |
| quantized weights (bytes and scales) | as saved where the parameter has the same format on both sides; otherwise cast again from its high-precision weight |
| FusedAdam masters of high-precision parameters | as saved where both sides keep masters; otherwise set from the parameter (FusedAdam does not step them: they are its initial copy) |
| DelayedScaling amax histories and scales | for the modules both recipes keep them for: every TE module under fp8_delayed, the attention modules under fp8_cs/mxfp8/nvfp4 with fp8_attention (checkpoint/te_state.py); otherwise they start fresh |

`PrecisionPlan` decides this per parameter from the recipe the checkpoint was saved with (its
config.yaml and step: recipes/switch.py `saved_recipe`) and the recipe of this run, and shapes
the model and optimizer load requests (checkpoint/state.py): a parameter whose format or
master-keeping differs is "translated": the entries that hold its high-precision value are
loaded (into the run's master, the parameter, or a buffer), the others are skipped on purpose
(`skipped`, which the manager's completeness check accepts), and after the load the parameter
and its master are set from that value. Parameters of the same format are loaded as before,
so a resume under the same recipe is unchanged. Nothing here imports TE.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from torch.distributed.tensor import DTensor

from model.init import canonical_name
from recipes.amax import local_tensor, weight_quantizers
from recipes.config import RecipeConfig
from recipes.recipe import ATTENTION_BORROWS_DELAYED, resolve_bf16_layers
from recipes.switch import label

MASTER = "master_param"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Recipe fields that do not change how a quantized weight is stored.
_NOT_FORMAT = (
    "quantized_init",
    "bf16_layers",
    "switch",
    "amax_history_len",
    "amax_compute_algo",
    "margin",
    "fp8_attention",
)


def scaling_kept(cfg: RecipeConfig) -> str | None:
    """Which modules keep delayed-scaling amax histories and scales under `cfg`: "all"
    (fp8_delayed), "attention" (fp8_cs, mxfp8, nvfp4 with fp8_attention: TE's attention
    modules run delayed scaling of their own), or None."""
    if cfg.name == "fp8_delayed":
        return "all"
    if cfg.fp8_attention and cfg.name in ATTENTION_BORROWS_DELAYED:
        return "attention"
    return None


def weight_format(cfg: RecipeConfig | None, fqn: str, quantizable: frozenset[str], n_layers: int):
    """How `cfg` stores parameter `fqn`: None (high precision) or a key naming its quantized
    format (the recipe and its fields that shape the stored weight)."""
    if cfg is None or cfg.name == "bf16" or not cfg.quantized_init or fqn not in quantizable:
        return None
    m = _LAYER.search(fqn)
    if m is not None and int(m.group(1)) in resolve_bf16_layers(cfg.bf16_layers, n_layers):
        return None
    return tuple((f.name, getattr(cfg, f.name)) for f in fields(cfg) if f.name not in _NOT_FORMAT)


def _empty_like(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized high-precision tensor placed like `param` (same DTensor layout)."""
    local = local_tensor(param)
    buf = torch.empty(tuple(local.shape), dtype=dtype, device=local.device)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            buf, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return buf


@dataclass
class _Param:
    """One translated parameter: where its high-precision value comes from and goes."""

    fqn: str
    saved_quantized: bool
    run_quantized: bool
    buffer: torch.Tensor | None = None  # loaded from the checkpoint when no run tensor fits


@dataclass
class PrecisionPlan:
    """What a load under `recipe` does with a checkpoint saved under `saved` (see the module
    docstring). `plan(...)` runs once the checkpoint's recipe is known; `translated` is empty
    when nothing differs, and then the load is the plain one."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    recipe: object  # recipes.Recipe of this run
    log: Callable[[str], None] | None = None
    saved: RecipeConfig | None = None
    translated: dict[str, _Param] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)  # "model.<fqn>" / "optimizer.state..."
    report: list[str] = field(default_factory=list)
    saved_keys: frozenset[str] = frozenset()

    def params(self) -> dict[str, torch.Tensor]:
        return {canonical_name(n): p for n, p in self.model.named_parameters()}

    @property
    def run_masters(self) -> bool:
        return bool(getattr(self.optimizer, "master_weights", False))

    def plan(self, saved: RecipeConfig | None, saved_keys) -> None:
        """Decide per parameter. saved: the checkpoint's recipe (None: unknown, assume this
        run's); saved_keys: the checkpoint's entry names (DCP metadata)."""
        self.saved, self.translated, self.skipped, self.report = saved, {}, set(), []
        self.saved_keys = frozenset(saved_keys)
        if saved is None:
            return
        run = self.recipe.cfg
        quantizable = frozenset(canonical_name(w.name) for w in weight_quantizers(self.model))
        n = self.recipe.n_layers
        saved_masters = any(
            k.startswith("optimizer.state.") and k.endswith("." + MASTER) for k in saved_keys
        )
        run_masters = self.run_masters
        params = self.params()
        same_format = saved_quantized = 0
        for fqn in params:
            s = weight_format(saved, fqn, quantizable, n)
            r = weight_format(run, fqn, quantizable, n)
            saved_quantized += s is not None
            if s == r and saved_masters == run_masters:
                same_format += s is not None
                continue
            if s is not None and f"optimizer.state.{fqn}.{MASTER}" not in self.saved_keys:
                raise RuntimeError(f"checkpoint holds quantized {fqn} without its fp32 master")
            self.translated[fqn] = _Param(fqn, s is not None, r is not None)
        self._describe(saved, saved_masters, same_format, saved_quantized)

    def _describe(
        self, saved: RecipeConfig, saved_masters: bool, same_format: int, from_masters: int
    ) -> None:
        run = self.recipe.cfg
        if not self.translated and _same_recipe(saved, run):
            return
        recast = sum(p.run_quantized for p in self.translated.values())
        kept = (scaling_kept(saved), scaling_kept(run))
        self.report = [
            f"precision: checkpoint saved with {label(saved)}, this run uses {label(run)}",
            f"precision: high-precision weights carried over exactly ({from_masters} from fp32 "
            f"masters of quantized weights, the others from the parameters); optimizer moments "
            f"carried over exactly",
            f"precision: quantized weights: {same_format} loaded as saved, {recast} cast again "
            f"from their high-precision weights",
            "precision: fp32 masters of high-precision parameters: "
            + (
                "none kept by this run"
                if not self.run_masters
                else ("loaded as saved" if saved_masters else "set from the parameters")
            ),
            "precision: delayed-scaling amax history and scales: " + _scaling_report(*kept),
        ]

    # -- load requests (checkpoint/state.py) ------------------------------------------------

    def model_request(self, sd: dict) -> dict:
        """The model part's request: translated parameters saved quantized are not loaded
        (their fp32 master is the value); high-precision ones bound for a quantized parameter
        are loaded into a buffer."""
        params = self.params()
        for fqn, p in self.translated.items():
            if p.saved_quantized:
                sd.pop(fqn, None)
                self.skipped.add(f"model.{fqn}")
            elif p.run_quantized:
                p.buffer = _empty_like(params[fqn], torch.float32)
                sd[fqn] = p.buffer
        return sd

    def model_loaded(self, sd: dict) -> tuple[dict, set[str]]:
        """The loaded model entries to set as parameters, and the names that are set later."""
        later = {p.fqn for p in self.translated.values() if p.saved_quantized or p.run_quantized}
        return {k: v for k, v in sd.items() if k not in later}, later

    def optimizer_request(self, sd: dict) -> dict:
        """The optimizer part's request: a translated parameter's saved master is loaded when it
        is the high-precision value (into the run's master, or a buffer) and skipped otherwise;
        a run master the checkpoint lacks is filled after the load."""
        params = self.params()
        for fqn, p in self.translated.items():
            key = f"state.{fqn}.{MASTER}"
            if p.saved_quantized:
                if key not in sd:  # this run keeps no master: load it into a buffer
                    p.buffer = _empty_like(params[fqn], torch.float32)
                    sd[key] = p.buffer
            else:
                if key in sd:
                    del sd[key]  # filled after the load, from the high-precision value
                if f"optimizer.{key}" in self.saved_keys:
                    self.skipped.add(f"optimizer.{key}")
        return sd

    def optimizer_loaded(self, sd: dict) -> dict:
        """Before set_optimizer_state_dict: drop buffers that are no optimizer state, and fill
        the masters the checkpoint did not hold for this run."""
        params = self.params()
        for fqn, p in self.translated.items():
            key = f"state.{fqn}.{MASTER}"
            if p.saved_quantized and not self.run_masters:
                sd.pop(key, None)
            elif not p.saved_quantized and self.run_masters:
                value = p.buffer if p.buffer is not None else params[fqn].detach()
                sd[key] = _as_master(value, sd, fqn)
        return sd

    @torch.no_grad()
    def finish(self) -> None:
        """After the optimizer state is in: each translated parameter from its high-precision
        value (a quantized one cast again, as FusedAdam's step does: `quantize_(master)`)."""
        params = self.params()
        for fqn, p in self.translated.items():
            param = params[fqn]
            local = local_tensor(param)
            if self.run_masters:
                hp = local_tensor(self.optimizer.get_unscaled_state(param, MASTER))
            elif p.buffer is not None:
                hp = local_tensor(p.buffer)
            else:
                continue  # loaded into the parameter directly
            if p.run_quantized:
                local.quantize_(hp)
            elif p.saved_quantized:
                local.copy_(hp)
            p.buffer = None
        if self.log is not None:
            for line in self.report:
                self.log(line)


def _scaling_report(saved: str | None, run: str | None) -> str:
    """What a load does with the delayed-scaling state (checkpoint/te_state.py loads the
    modules both recipes keep it for)."""
    if saved is None:
        return "not used" if run is None else "start fresh (the checkpoint's recipe keeps none)"
    if run is None:
        return "not used by this recipe (left out)"
    if saved == run:
        return "carried over"
    if saved == "all":  # run: attention only
        return "carried over for the attention modules (the others' not used by this recipe)"
    return "carried over for the attention modules (the checkpoint's recipe kept no others)"


def _same_recipe(a: RecipeConfig, b: RecipeConfig) -> bool:
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a) if f.name != "switch")


def _as_master(value: torch.Tensor, sd: dict, fqn: str) -> torch.Tensor:
    """`value` as an fp32 optimizer state shaped like the others of its parameter."""
    like = sd.get(f"state.{fqn}.exp_avg")
    out = value.detach().to(torch.float32).clone()
    if (
        isinstance(like, torch.Tensor)
        and not isinstance(like, DTensor)
        and isinstance(out, DTensor)
    ):
        out = out.to_local()
    return out
