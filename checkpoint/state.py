"""What a checkpoint holds: one Stateful per concern (docs/ARCHITECTURE.md, decision 8).

    state = training_state(model, optimizer, scheduler, loader, train_state)
    # {"train", "model", "optimizer", "scheduler", "loader", "rng"} (+ "te_scaling")

Model and optimizer go through torch.distributed.checkpoint.state_dict (FQN keys without
wrapper prefixes, DTensor values), so DCP reshards them on load: any world size, any layout.
Everything else is small and replicated, except RNG states, which are per rank.

Optional protocol used by the manager on load: `load_request(saved)` receives the checkpoint's
metadata for this part's keys (prefix stripped) and returns the structure to load into, for
parts whose shape depends on the checkpoint (per-rank RNG keys, TE scaling tensors, the model
and optimizer of a run whose recipe differs from the checkpoint's); `plan_load(config, step,
keys)` comes first, with the checkpoint's saved config (a dict, or None), step and entry names;
`skipped_entries()` names checkpoint entries a part leaves out on purpose.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from checkpoint import te_state
from checkpoint.precision import PrecisionPlan
from recipes.quantized import requantize_from_masters
from recipes.switch import saved_recipe

#: Flattened optimizer keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") do not depend on
#: how parameters are grouped, which keeps resharded loads simple.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_EXTRA_STATE = "_extra_state"


@dataclass
class TrainState(Stateful):
    """Counters and identity of the run. `config_yaml` is the current resolved config; the one
    saved with a checkpoint comes back as `saved_config_yaml` (the current one is kept).
    `on_load`, if set, is called with this object once a checkpoint's values are in it: it
    is the first part loaded (`training_state` puts it first), so a config check there runs
    before the other parts' own checks."""

    step: int = 0
    tokens_seen: int = 0
    wandb_run_id: str | None = None
    config_yaml: str | None = None
    saved_config_yaml: str | None = None
    on_load: Any = field(default=None, repr=False, compare=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": int(self.step),
            "tokens_seen": int(self.tokens_seen),
            "wandb_run_id": self.wandb_run_id or "",
            "config_yaml": self.config_yaml or "",
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.wandb_run_id = sd["wandb_run_id"] or None
        self.saved_config_yaml = sd["config_yaml"] or None
        if self.on_load is not None:
            self.on_load(self)


class ModelState(Stateful):
    """Model parameters and buffers. TE `_extra_state` entries are left out: under FSDP2 they
    do not load through DCP (TE issue 1860; their size changes once FP8 runs); the scaling
    state they carry is saved by TEScalingState instead. With a `PrecisionPlan` (the run's
    recipe is known), a checkpoint of another recipe loads too (checkpoint/precision.py)."""

    def __init__(self, model: torch.nn.Module, plan: PrecisionPlan | None = None):
        self.model = model
        self.plan = plan

    def state_dict(self) -> dict[str, Any]:
        sd = get_model_state_dict(self.model)
        return {k: v for k, v in sd.items() if not k.endswith(_EXTRA_STATE)}

    def plan_load(self, config: Mapping[str, Any] | None, step: int, keys) -> None:
        if self.plan is not None:
            self.plan.plan(saved_recipe(config, step), keys)

    def load_request(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        sd = self.state_dict()
        return self.plan.model_request(sd) if self.plan is not None else sd

    def skipped_entries(self) -> set[str]:
        return set(self.plan.skipped) if self.plan is not None else set()

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        later: set[str] = set()
        sd = dict(sd)
        if self.plan is not None:
            sd, later = self.plan.model_loaded(sd)
        result = set_model_state_dict(self.model, sd, options=StateDictOptions(strict=False))
        missing = [
            k for k in result.missing_keys if not k.endswith(_EXTRA_STATE) and k not in later
        ]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"model state mismatch: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )


class OptimizerState(Stateful):
    """Optimizer state with DTensor moments (and TE FusedAdam master weights)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: PrecisionPlan | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.plan = plan
        self._wrapped: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        sd = get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIM_OPTIONS)
        # Older TE FusedAdam keeps plain local states for DTensor parameters (TE PR 2795);
        # saved as such they would not reshard. No-op where states already are DTensors.
        self._wrapped = te_state.optimizer_states_as_dtensors(sd, self.model)
        return sd

    def load_request(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        sd = self.state_dict()
        return self.plan.optimizer_request(sd) if self.plan is not None else sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        sd = dict(sd)
        te_state.optimizer_states_to_local(sd, self._wrapped)
        if self.plan is not None:
            sd = self.plan.optimizer_loaded(sd)
        set_optimizer_state_dict(self.model, self.optimizer, sd, options=_OPTIM_OPTIONS)
        # Block-scaled quantized weights: rebuilt from the masters just loaded (the model
        # loads first; DCP calls load_state_dict in state-dict order).
        requantize_from_masters(self.optimizer)
        if self.plan is not None:  # parameters of another format: from their high precision
            self.plan.finish()


class ObjectState(Stateful):
    """Anything with state_dict/load_state_dict whose state is small and identical on every
    rank (LR scheduler, data loader position): DCP stores one copy."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.obj.load_state_dict(dict(sd))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RNGState(Stateful):
    """CPU, CUDA (current device) and Python `random` generator states, one set per rank,
    under rank-suffixed keys so every rank saves and restores its own stream.

    A rank absent from the checkpoint (resuming on more ranks than saved it) gets a
    deterministic fallback: every generator seeded from a hash of rank 0's saved CPU state and
    the new rank number, so a given checkpoint and world size always continue the same way.
    numpy's global generator is not saved (nothing here draws from it).
    """

    def state_dict(self) -> dict[str, Any]:
        r = _rank()
        sd: dict[str, Any] = {
            f"cpu_rank{r}": torch.get_rng_state(),
            f"python_rank{r}": list(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd[f"cuda_rank{r}"] = torch.cuda.get_rng_state()
        return sd

    def load_request(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        r = _rank()
        own = self.state_dict()
        request = {k: v for k, v in own.items() if k in saved}
        if f"cpu_rank{r}" not in saved and "cpu_rank0" in saved:
            request["cpu_rank0"] = torch.get_rng_state()
        return request

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        r = _rank()
        if f"cpu_rank{r}" not in sd:
            if "cpu_rank0" not in sd:
                return
            digest = hashlib.sha256(sd["cpu_rank0"].numpy().tobytes() + f"/rank{r}".encode())
            seed = int(digest.hexdigest()[:15], 16)
            torch.manual_seed(seed)  # also seeds every CUDA device
            random.seed(seed)
            return
        torch.set_rng_state(sd[f"cpu_rank{r}"])
        if f"python_rank{r}" in sd:
            version, internal, gauss = sd[f"python_rank{r}"]
            random.setstate((version, tuple(internal), gauss))
        if f"cuda_rank{r}" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd[f"cuda_rank{r}"].cpu())


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader: Any,
    train_state: TrainState,
    *,
    te_recipe: Any = None,
    recipe: Any = None,
    log: Any = None,
) -> dict[str, Stateful]:
    """Everything a resume needs, as DCP Statefuls. `te_recipe`: the TE recipe object of the
    run; with a DelayedScaling recipe and TE modules in the model, their amax histories and
    scales are saved too ("te_scaling"). `recipe`: the run's `recipes.Recipe`; with it a
    checkpoint saved under another recipe loads too, `log` gets what carried over, and under
    fp8_cs/mxfp8/nvfp4 with recipe.fp8_attention the attention modules' delayed scaling is
    saved ("te_scaling", loaded with `recipe.attention_te_recipe()`)."""
    plan = PrecisionPlan(model, optimizer, recipe, log) if recipe is not None else None
    # Loaded in this order (the model before the optimizer: see OptimizerState).
    state: dict[str, Stateful] = {
        "train": train_state,
        "model": ModelState(model, plan),
        "optimizer": OptimizerState(model, optimizer, plan),
        "scheduler": ObjectState(scheduler),
        "loader": ObjectState(loader),
        "rng": RNGState(),
    }
    attention_recipe = recipe.attention_te_recipe() if recipe is not None else None
    scaling = te_state.delayed_scaling_state(model, te_recipe, attention_recipe)
    if scaling is not None:
        state["te_scaling"] = scaling
    return state
