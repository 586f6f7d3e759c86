"""Recipe switches during a run (`recipe.switch`): which recipe trains which step.

    recipe.switch=[{at: 0.8, name: bf16}]          # fp8 for 80% of the schedule, then bf16
    recipe.switch=[{at: 1000, bf16_layers: [0, -1]}, {at: 0.9, name: bf16}]

An entry's `at` is the last step of the recipe before it (a step, or a fraction of the LR
schedule's length); the steps after it train with the entry's fields applied. So a checkpoint
at step k holds the state of the recipe that trained step k (`recipe_for_step(cfg, k, ...)`),
and a run resumed from it continues with `recipe_for_step(cfg, k + 1, ...)`. The schedule is part
of the config (a change of it is a change of the training, refused on resume unless
accepted); train.py applies each switch in the running job through the checkpoint of its step
(docs/RECIPE_SWITCH.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from errors import ConfigError
from recipes.config import RecipeConfig, RecipeSwitchConfig
from recipes.recipe import FP8_ATTENTION_RECIPES


@dataclass(frozen=True)
class Switch:
    """A resolved entry: after `step`, train with `recipe` (its `switch` list emptied)."""

    step: int
    recipe: RecipeConfig


def _field(entry, name: str):
    return entry.get(name) if isinstance(entry, dict) else getattr(entry, name, None)


def switch_step(at: float, schedule_steps: int, index: int) -> int:
    """`at` as a step: an integer >= 1 is a step, a value in (0, 1) a share of the schedule."""
    where = f"recipe.switch[{index}].at={at:g}"
    if at is None or not at > 0:
        raise ConfigError(
            f"{where} must be a step >= 1 or a fraction of the schedule in (0, 1), e.g. 0.8"
        )
    if at < 1:
        step = math.floor(at * schedule_steps + 1e-9)
        if step < 1:
            raise ConfigError(
                f"{where} is step {at * schedule_steps:g} of a {schedule_steps}-step schedule, "
                "before the first step; use a larger fraction or a step >= 1"
            )
        return step
    if at != int(at):
        raise ConfigError(
            f"{where} is neither a whole step nor a fraction in (0, 1); use e.g. {int(at)} or 0.8"
        )
    return int(at)


def label(cfg: RecipeConfig) -> str:
    """A recipe as the logs name it: fp8_cs+quantized_init+fp8_attention bf16_layers=[0]."""
    text = cfg.name + ("+quantized_init" if cfg.quantized_init and cfg.name != "bf16" else "")
    text += "+fp8_attention" if cfg.fp8_attention and cfg.name in FP8_ATTENTION_RECIPES else ""
    if list(cfg.bf16_layers):
        text += f" bf16_layers={list(cfg.bf16_layers)}"
    return text


#: The on/off fields a switch entry may set, and the recipes that turn each off (with why it
#: cannot be on there): switching to one of them sets the field false.
_FLAGS_OFF = {
    "quantized_init": {"bf16": "has no effect with name=bf16 (nothing is quantized)"},
    "fp8_attention": {
        "bf16": "has no effect with name=bf16 (nothing runs in FP8)",
        "fp8_block": "is not available with name=fp8_block (TE 2.20 has no FP8 attention for "
        "FP8 block scaling)",
    },
}


def _flag_change(entry, i: int, name: str | None, flag: str) -> bool | None:
    """What switch entry `i` (to recipe `name`, None: unchanged) sets `flag` to: False where
    `name` turns it off (ConfigError if the entry asks for true there), the entry's value, or
    None (unchanged)."""
    value = _field(entry, flag)
    why = _FLAGS_OFF[flag].get(name)
    if why is not None:
        if value:
            raise ConfigError(f"recipe.switch[{i}]: {flag}=true {why}; drop {flag} from this entry")
        return False
    return None if value is None else bool(value)


def resolve_switches(cfg: RecipeConfig, schedule_steps: int) -> list[Switch]:
    """The switches of `cfg.switch` in step order, each with the full recipe in force after it.
    Raises ConfigError (one line, naming the entry) for an entry that cannot be applied."""
    resolved: list[Switch] = []
    current = replace(cfg, switch=[])
    last = 0
    for i, entry in enumerate(cfg.switch):
        step = switch_step(_field(entry, "at"), schedule_steps, i)
        if step <= last:
            raise ConfigError(
                f"recipe.switch[{i}] is at step {step}, not after the previous switch (step "
                f"{last}); list the switches in step order, one per step"
            )
        changes = {}
        name = _field(entry, "name")
        if name is not None:
            changes["name"] = name
        for flag in _FLAGS_OFF:
            value = _flag_change(entry, i, name, flag)
            if value is not None:
                changes[flag] = value
        layers = _field(entry, "bf16_layers")
        if layers is not None:
            changes["bf16_layers"] = [int(x) for x in layers]
        if not changes:
            raise ConfigError(
                f"recipe.switch[{i}] changes nothing; give name, quantized_init, bf16_layers "
                "or fp8_attention"
            )
        current = replace(current, **changes)
        resolved.append(Switch(step, current))
        last = step
    return resolved


def recipe_for_step(cfg: RecipeConfig, step: int, schedule_steps: int) -> RecipeConfig:
    """The recipe that trains `step` (1-based): the last switch before it, else `cfg`."""
    current = replace(cfg, switch=[])
    for switch in resolve_switches(cfg, schedule_steps):
        if switch.step < step:
            current = switch.recipe
    return current


def saved_recipe(config: dict | None, step: int) -> RecipeConfig | None:
    """The recipe whose state a checkpoint at `step` holds, from the resolved config saved with
    it (a dict of config.yaml); None when the checkpoint has no config. Fields the saved
    config predates take their defaults."""
    if not config or not isinstance(config.get("recipe"), dict):
        return None
    known = set(RecipeConfig.__dataclass_fields__)
    raw = {k: v for k, v in config["recipe"].items() if k in known}
    raw["switch"] = [
        RecipeSwitchConfig(
            **{
                k: v
                for k, v in dict(e).items()
                if k in ("at", "name", "quantized_init", "bf16_layers", "fp8_attention")
            }
        )
        for e in raw.get("switch") or []
    ]
    cfg = RecipeConfig(**raw)
    optim, train = config.get("optim") or {}, config.get("train") or {}
    schedule = optim.get("schedule_steps") or train.get("steps") or 1
    return recipe_for_step(cfg, step, int(schedule))
