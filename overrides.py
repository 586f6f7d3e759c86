"""The command line's overrides, checked before Hydra runs them: every wrong one is one
`ConfigError` line naming the field and the fix.

Hydra reports a wrong override in 6-13 lines of its own (and a `+key` that adds a key the
schema does not have is not wrong to it at all: `+modle=small` composes, with a stray
`modle`). `check_overrides` composes the command line's config the way `train.py` will (the
compose API over conf/), before Hydra's own entry point, and turns what fails into one line:

    modle=small         modle: no such config group or key; did you mean model? ...
    recipe=fp16         recipe: no option 'fp16'; choose one of bf16, fp8_block, ...
    train.foo=1         train.foo: no such key in train; did you mean ...? its keys: ...
    +train.foo=1        train.foo: no such key in train ... (`+` adds keys; this schema is fixed)
    train.steps=abc     train.steps: 'abc' is not an int; give a whole number, e.g. ...

A multirun's jobs are checked one by one (each swept value composed on its own).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

from errors import ConfigError

#: Hydra flags that change what is composed: with one of them the check leaves it to Hydra.
CONFIG_FLAGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")

#: Hydra flags whose value is one of a few words: argparse answers a wrong one with its
#: usage block (7 lines) before the error; checked here first.
FLAG_CHOICES = {
    "--cfg": ("job", "hydra", "all"),
    "-c": ("job", "hydra", "all"),
    "--info": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
    "-i": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
}
#: Of those, the flags that may also stand alone (`--info` means `--info all`).
_OPTIONAL_VALUE = ("--info", "-i")

#: Free-form groups: any key below them is accepted (`+experiment.note=...`).
FREE_FORM = ("experiment",)


def _groups() -> list[str]:
    from config import CONF_DIR

    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def _options(group: str) -> list[str]:
    from config import CONF_DIR

    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _schema() -> dict:
    from config import schema_defaults

    return schema_defaults()


def _node(tree: Any, path: str) -> Any:
    for part in path.split(".") if path else []:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


#: Names other trainers give these fields (the spelling a user is likely to bring): the key
#: they mean here, when the section has it.
ALIASES = {
    "learning_rate": "lr",
    "max_lr": "lr",
    "max_steps": "steps",
    "num_steps": "steps",
    "total_steps": "steps",
    "train_steps": "steps",
    "batch_size": "global_batch_size",
    "max_grad_norm": "grad_clip",
    "clip_grad": "grad_clip",
    "gradient_clipping": "grad_clip",
    "warmup": "warmup_steps",
    "seq_length": "seq_len",
    "max_seq_length": "seq_len",
    "sequence_length": "seq_len",
    "wd": "weight_decay",
}


def _close(word: str, choices: Sequence[str], prefix: str = "") -> str:
    """ "did you mean X? " for the nearest of `choices` (or the key `word` is another
    trainer's name for), as written on the command line (`prefix`: its section)."""
    choices = list(choices)
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if ALIASES.get(word.lower()) in choices:
        match = [ALIASES[word.lower()]]
    return f"did you mean {prefix}{match[0]}? " if match else ""


def unknown_key(path: str) -> str:
    """The line for a key the schema does not have."""
    schema = _schema()
    parent, _, leaf = path.rpartition(".")
    if parent and parent.split(".")[0] in FREE_FORM:
        return f"{path}: {parent} holds free-form metadata; add keys with +{path}=VALUE"
    node = _node(schema, parent)
    while parent and not isinstance(node, dict):  # the nearest existing ancestor
        path_parent, _, _ = parent.rpartition(".")
        parent, node = path_parent, _node(schema, path_parent)
        leaf = path[len(parent) + 1 :] if parent else path
    if not parent:
        groups = _groups()
        sections = [k for k in schema if k not in groups]
        return (
            f"{path}: no such config group or key; {_close(leaf.split('.')[0], list(schema))}"
            f"groups (GROUP=OPTION): {', '.join(groups)}; sections (SECTION.FIELD=VALUE): "
            f"{', '.join(sections)}"
        )
    keys = list(node)
    return (
        f"{parent}.{leaf}: no such key in {parent}; {_close(leaf, keys, parent + '.')}its keys: "
        f"{', '.join(keys)}"
    )


_TYPES = {
    "Integer": ("an int", "a whole number"),
    "Float": ("a number", "a number"),
    "Boolean": ("a bool", "true or false"),
}


def _example(path: str) -> str:
    value = _node(_schema(), path)
    if value is None or isinstance(value, dict):
        return ""
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
    return f", e.g. {path}={shown}"


def _validation_line(key: str, value: Any, msg: str) -> str:
    if m := re.search(r"could not be converted to (\w+)", msg):
        what, give = _TYPES.get(m.group(1), (m.group(1).lower(), m.group(1).lower()))
        return f"{key}: {value!r} is not {what}; give {give}{_example(key)}"
    if "is not a valid bool" in msg:
        return f"{key}: {value!r} is not a bool; give true or false{_example(key)}"
    if "is not Optional" in msg:
        return f"{key}: null is not allowed; give a value{_example(key)}"
    if "is not a ListConfig, list or tuple" in msg:
        return f"{key}: {value!r} is not a list; write a list, e.g. {key}=[{value}]"
    if "is not a subclass of" in msg:
        if key in _groups():
            return (
                f"{key}: {value!r} is not an option of {key}; choose one of "
                f"{', '.join(_options(key))}"
            )
        node = _node(_schema(), key)
        keys = ", ".join(node) if isinstance(node, dict) else ""
        return f"{key}: a section, not a value; set its fields, {key}.FIELD=VALUE (fields: {keys})"
    return f"{key}: {msg.splitlines()[0]}"


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def error_line(e: BaseException, override: str = "") -> str:
    """One line for an exception of Hydra's or OmegaConf's composing the config."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    chain = _chain(e)
    for x in chain:
        if isinstance(x, MissingConfigException) and x.missing_cfg_file:
            group, _, option = str(x.missing_cfg_file).rpartition("/")
            if group and x.options:
                return (
                    f"{group}: no option {option!r}; choose one of {', '.join(x.options)} "
                    f"(files of conf/{group}/)"
                )
        if isinstance(x, ConfigAttributeError | ConfigKeyError) and x.full_key:
            return unknown_key(str(x.full_key))
        if isinstance(x, ValidationError) and x.full_key:
            return _validation_line(str(x.full_key), x.value, str(x).splitlines()[0])
        if isinstance(x, OverrideParseException):
            return (
                f"{override or 'override'}: not a valid override ({str(x).splitlines()[0]}); "
                "write KEY=VALUE, e.g. train.steps=100 (quote values with spaces or brackets)"
            )
    text = " ".join(str(e).split())
    if m := re.search(r"Multiple values for (\S+?)\.", text):
        group = m.group(1)
        return (
            f"{group}: a group of the defaults list; select an option with {group}=OPTION (no '+')"
        )
    if m := re.search(r"An item is already at '([^']+)'", text):
        return f"{m.group(1)}: already in the config; set it with {m.group(1)}=VALUE (without '+')"
    return f"{override + ': ' if override else ''}{text}"


def check_adds(overrides: Sequence[str]) -> None:
    """A `+key=...` / `++key=...` may add only to free-form groups (experiment) or select an
    optional group; the rest of the schema is fixed, so an added key would be a typo that runs
    silently (`+modle=small`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    schema, groups = _schema(), _groups()
    for line in overrides:
        try:
            o = parser.parse_override(line)
        except Exception as e:
            raise ConfigError(
                f"{line}: not a valid override ({' '.join(str(e).split())}); write KEY=VALUE, "
                "e.g. train.steps=100 (quote values with spaces or brackets)"
            ) from None
        key = o.key_or_group
        if not (o.is_add() or o.is_force_add()) or key.startswith(("hydra.", "hydra/")):
            continue
        if key.split(".")[0] in FREE_FORM or (o.is_add() and key in groups):
            continue
        if _node(schema, key) is None:
            raise ConfigError(
                f"{unknown_key(key)} ('+' adds a key, and this config's keys are fixed)"
            )


def job_overrides(argv: Sequence[str]) -> list[list[str]] | None:
    """The overrides of each job the command line runs (one for a plain run), hydra.* ones
    left out; None when the check should leave the command line to Hydra (a config flag)."""
    import sweep

    if any(a.split("=", 1)[0] in CONFIG_FLAGS for a in argv):
        return None
    task = [
        a for a in sweep.override_args(argv) if not a.lstrip("+~").startswith(("hydra.", "hydra/"))
    ]
    if not sweep.is_multirun(argv):
        return [task]
    try:
        return [job for job, _ in sweep.expand(task)]
    except ConfigError:
        return None  # a range/interval sweep: Hydra's sweeper expands it
    except Exception:
        return [task]  # unparseable: reported by check_overrides


def check_overrides(argv: Sequence[str]) -> None:
    """Raises ConfigError (one line) for the first wrong override of the command line."""
    from config import compose_config

    jobs = job_overrides(argv)
    for job in jobs or []:
        check_adds(job)
        try:
            compose_config(job)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(error_line(e)) from None


def check_flags(argv: Sequence[str]) -> None:
    """Raises ConfigError (one line) for a Hydra flag of FLAG_CHOICES with a value it does not
    take (`--cfg jobs`), or without the value it needs."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in FLAG_CHOICES:
            continue
        choices = FLAG_CHOICES[flag]
        if not eq:
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is None or following.startswith("-") or "=" in following:
                if flag in _OPTIONAL_VALUE:
                    continue
                raise ConfigError(
                    f"{flag} needs one of {', '.join(choices)}; e.g. python train.py {flag} "
                    f"{choices[0]}"
                )
            value = following
        if value not in choices:
            close = difflib.get_close_matches(value, choices, n=1)
            hint = f"did you mean {flag} {close[0]}? " if close else ""
            raise ConfigError(
                f"{flag} {value}: not one of {', '.join(choices)}; {hint}e.g. python train.py "
                f"{flag} {close[0] if close else choices[0]}"
            )
