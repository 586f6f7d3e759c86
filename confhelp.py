"""The config reference: every field of the schema with its default and description, and the
options of each config group. `python train.py --help` prints it; docs/CONFIGURATION.md is
generated from it.

    python train.py --help                      # every field, grouped, and the group options
    python train.py --help model parallel.cp    # fields under these prefixes only
    python train.py --help lr                   # no field starts with it: fields named with it
    python train.py --help model=llama3_8b      # defaults as composed with these overrides
    python confhelp.py --write                  # regenerate docs/CONFIGURATION.md

Descriptions are the `#:` comment lines right above each dataclass field (config.py and each
group's config.py), read from the source, so a field is described in one place only. Defaults
are what `python train.py` runs with (the schema merged with the default option of each
group), not the bare dataclass defaults. Group options are the files of conf/<group>/, each
described by the first sentence of its header comment.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CONF_DIR = ROOT / "conf"
DOCS_PATH = ROOT / "docs" / "CONFIGURATION.md"
#: The one command that rewrites docs/CONFIGURATION.md (tests/test_config_docs.py prints it).
REGENERATE = "python confhelp.py --write"


@dataclass
class FieldDoc:
    path: str  # dotted, as on the command line: train.steps; list entries: recipe.switch[].at
    type: str  # int, str | null, list[int], ...
    default: typing.Any  # what `python train.py` runs with; MISSING_VALUE when required
    doc: str  # the `#:` comment, joined into one line ("" when there is none)
    owner: str  # module.Class that declares it
    node: bool = False  # a nested dataclass whose fields follow it

    @property
    def shown_default(self) -> str:
        if self.node and isinstance(self.default, dict):
            return "{...}"
        return format_value(self.default)


class _Missing:
    def __repr__(self) -> str:
        return "(required)"


MISSING_VALUE = _Missing()


# --------------------------------------------------------------------------------------
# The schema, read from the dataclasses and their source


def field_comments(cls: type) -> dict[str, str]:
    """`#:` comment lines right above each field of a dataclass, joined into one line."""
    lines, start = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body  # the class's statements
    out = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        i = node.lineno - 2  # the line above the field, 0-based in `lines`
        comment: list[str] = []
        while i >= 0 and lines[i].strip().startswith("#:"):
            comment.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        out[node.target.id] = " ".join(c for c in comment if c)
    return out


def _type_name(tp: typing.Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _dataclass_in(tp: typing.Any) -> tuple[type | None, bool]:
    """The dataclass inside an annotation (X, X | None, list[X]) and whether it is a list."""
    if dataclasses.is_dataclass(tp):
        return tp, False
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    for a in args if origin is not list else ():
        if dataclasses.is_dataclass(a):
            return a, False
    return None, False


def _lookup(tree: typing.Any, path: str) -> typing.Any:
    node = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _dataclass_default(f: dataclasses.Field) -> typing.Any:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return MISSING_VALUE
    if value == "???":  # omegaconf.MISSING
        return MISSING_VALUE
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def schema_fields(composed: dict | None = None) -> list[FieldDoc]:
    """Every field of the root `Config`, depth first, in declaration order. `composed`: the
    config to take defaults from (default: `python train.py`'s, see `composed_defaults`)."""
    from config import Config

    if composed is None:
        composed = composed_defaults()
    out: list[FieldDoc] = []

    def walk(cls: type, prefix: str, in_list: bool) -> None:
        hints = typing.get_type_hints(cls)
        docs = field_comments(cls)
        for f in dataclasses.fields(cls):
            path = f"{prefix}{f.name}"
            sub, is_list = _dataclass_in(hints[f.name])
            if sub is not None and not is_list and prefix == "":
                walk(sub, path + ".", in_list)  # a group node: its fields, not the node
                continue
            value = None if in_list else _lookup(composed, path)
            found = in_list or value is not None or _has(composed, path)
            default = value if found and not in_list else _dataclass_default(f)
            owner = f"{cls.__module__}.{cls.__qualname__}"
            doc = docs[f.name]
            out.append(
                FieldDoc(path, _type_name(hints[f.name]), default, doc, owner, sub is not None)
            )
            if sub is not None:
                walk(sub, path + ("[]." if is_list else "."), in_list or is_list)

    walk(Config, "", False)
    return out


def _has(tree: dict, path: str) -> bool:
    *parents, leaf = path.split(".")
    node = _lookup(tree, ".".join(parents)) if parents else tree
    return isinstance(node, dict) and leaf in node


def composed_defaults(overrides: typing.Sequence[str] = ()) -> dict:
    """The config `python train.py <overrides>` composes, unresolved (interpolations such as
    run.name's stay as written), without Hydra's own node."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.lru_cache(maxsize=8)
def _composed(overrides: tuple[str, ...]) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra", None)
    return tree


# --------------------------------------------------------------------------------------
# Group options: the files of conf/<group>/


def default_options() -> dict[str, str | None]:
    """Group -> the option conf/config.yaml's defaults list picks (None: optional, unset)."""
    import yaml

    out: dict[str, str | None] = {}
    for entry in yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            (key, value), *_ = entry.items()
            if key.startswith("override "):
                continue
            out[key.removeprefix("optional ")] = value
    return out


def option_summary(path: Path) -> str:
    """The first sentence of a YAML file's header comment."""
    text: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        line = line.lstrip("#").strip()
        if line.startswith("@package"):
            continue
        text.append(line)
    joined = " ".join(t for t in text if t)
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)[.!?])(\s|$)", joined)
    return match.group(1) if match else joined


def group_options() -> dict[str, list[tuple[str, str]]]:
    """Group -> [(option, summary)] for every folder of conf/."""
    return {
        group: [(p.stem, option_summary(p)) for p in sorted((CONF_DIR / group).glob("*.yaml"))]
        for group in default_options()
    }


# --------------------------------------------------------------------------------------
# Rendering


def format_value(value: typing.Any) -> str:
    """A value as it is written on the command line (YAML flow style)."""
    if value is MISSING_VALUE:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def _group_of(path: str) -> str:
    return path.split(".", 1)[0].split("[", 1)[0]


def _matches(path: str, prefixes: typing.Sequence[str]) -> bool:
    return not prefixes or any(
        path == p or path.startswith(p.rstrip(".") + ".") or path.startswith(p + "[")
        for p in prefixes
    )


def terminal_width() -> int:
    """Columns to wrap `--help` to: the terminal's (or $COLUMNS), 100 when not a terminal."""
    import shutil

    return max(60, shutil.get_terminal_size(fallback=(100, 24)).columns)


def _wrap(first: str, text: str, indent: int, width: int) -> list[str]:
    """`first` (e.g. "  train.steps = 300") with `text` beside it from column `indent`,
    wrapped to `width`; the text goes below `first` when `first` reaches into its column."""
    lines = []
    if len(first) + 2 > indent:
        lines += textwrap.wrap(first, width, subsequent_indent=" " * 6) or [first]
        first = ""
    if not text:
        return lines or [first]
    wrapped = textwrap.wrap(
        text,
        width,
        initial_indent=first.ljust(indent),
        subsequent_indent=" " * indent,
        break_on_hyphens=False,
    )
    return lines + wrapped


def render_text(
    prefixes: typing.Sequence[str] = (),
    overrides: typing.Sequence[str] = (),
    width: int | None = None,
) -> str:
    """`python train.py --help [prefix ...] [key=value ...]`: each field with its default and
    description, wrapped to `width` columns (default: the terminal's)."""
    width = width or terminal_width()
    fields = [f for f in schema_fields(composed_defaults(overrides)) if _matches(f.path, prefixes)]
    options, chosen = group_options(), default_options()
    command = f"python train.py{''.join(' ' + o for o in overrides)}"
    lines = [
        *textwrap.wrap(
            "usage: python train.py [group=option ...] [field=value ...]   (torchrun ... "
            "train.py ...)",
            width,
            subsequent_indent=" " * 6,
        ),
        "",
        *textwrap.wrap(
            "Every config field: name = default, then its description. Defaults are those of "
            f"`{command}`; set a field with group.field=value, a group's option with "
            "group=option.",
            width,
        ),
        "",
    ]
    for cmd, what in (
        ("--help model parallel.cp", "only the fields under these prefixes"),
        ("--help lr", "the fields named with a word"),
        ("--help model=llama3_8b", "the defaults of another config"),
        ("--cfg job", "the whole composed config, as YAML"),
        ("-m optim.lr=1e-3,3e-3", "a sweep: one run per value (docs/RUNS.md, Sweeps)"),
        ("--hydra-help", "Hydra's own flags"),
    ):
        lines += _wrap(f"  python train.py {cmd}", f"# {what}", 44 if width >= 84 else 6, width)
    left_width = max((len(f"{f.path} = {f.shown_default}") for f in fields), default=0)
    column = min(left_width, 44) + 4
    if width - column < 40:  # a narrow terminal: descriptions below their field
        column = 6
    group = None
    for f in fields:
        if _group_of(f.path) != group:
            group = _group_of(f.path)
            heading = _group_heading(group, options, chosen)
            lines += ["", *textwrap.wrap(heading, width, subsequent_indent=" " * 4)]
        lines += _wrap(f"  {f.path} = {f.shown_default}", f.doc, column, width)
    if not prefixes:
        lines += ["", "Presets: experiment=<name> (conf/experiment/):"]
        for name, summary in options.get("experiment", []):
            lines += _wrap(f"  {name}", summary, 22, width)
    lines += ["", "Every field, with its type: docs/CONFIGURATION.md."]
    return "\n".join(lines) + "\n"


def _group_heading(group: str, options: dict, chosen: dict) -> str:
    if group not in options or group == "experiment":
        return f"{group}:"
    names = ", ".join(
        f"{name} (default)" if name == chosen.get(group) else name for name, _ in options[group]
    )
    return f"{group}: {group}={{{names}}}"


def _md_cell(text: str) -> str:
    """Table-cell text: `|` escaped, and `<...>` outside code spans kept from reading as HTML."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def render_markdown() -> str:
    """docs/CONFIGURATION.md."""
    fields = schema_fields()
    options, chosen = group_options(), default_options()
    out = [
        "# Configuration",
        "",
        f"<!-- Generated by `{REGENERATE}` from the `#:` comments of the config dataclasses and",
        "the files of conf/; do not edit by hand (tests/test_config_docs.py checks it). -->",
        "",
        "Every field of the config, by group. Set any of them on the command line as",
        "`group.field=value` (`python train.py train.steps=50 optim.lr=1e-3`), pick an option of",
        "a group as `group=option` (`model=small`), or a preset as `experiment=<name>`.",
        "`python train.py --help` prints the same reference (`--help model` narrows it,",
        "`--help model=llama3_8b` shows the defaults of that config).",
        "",
        "Defaults are those of `python train.py`: the schema merged with the default option of",
        "each group (" + ", ".join(f"`{g}={o}`" for g, o in chosen.items() if o) + ").",
        "Another option changes some of them (for example `model=llama3_8b` sets `model.dim` to",
        f"{_lookup(composed_defaults(['model=llama3_8b']), 'model.dim')}): its file in "
        "`conf/<group>/` lists the values it sets.",
        "",
        "## Group options",
        "",
        "| group | option | what it is |",
        "| --- | --- | --- |",
    ]
    for group, opts in options.items():
        for name, summary in opts:
            mark = " (default)" if name == chosen.get(group) else ""
            out.append(f"| `{group}` | `{name}`{mark} | {_md_cell(summary)} |")
    group = None
    for f in fields:
        if _group_of(f.path) != group:
            group = _group_of(f.path)
            out += ["", f"## `{group}`", "", "| field | type | default | description |"]
            out.append("| --- | --- | --- | --- |")
        default = f.shown_default
        out.append(
            f"| `{f.path}` | {_md_cell(f.type)} | `{_md_cell(default)}` | {_md_cell(f.doc)} |"
        )
    return "\n".join(out) + "\n"


def undocumented() -> list[str]:
    """Fields without a `#:` description, as `path (module.Class)`."""
    return [f"{f.path} ({f.owner})" for f in schema_fields() if not f.doc]


def no_field_line(prefixes: typing.Sequence[str]) -> str:
    """The line for `--help PREFIX` that matches no field: the nearest field or group named."""
    import difflib

    paths = [f.path for f in schema_fields()]
    names = sorted({p.split(".")[0] for p in paths} | set(paths))
    near = [m for p in prefixes for m in difflib.get_close_matches(p, names, n=1, cutoff=0.6)]
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return f"no config field starts with {' or '.join(prefixes)}{hint}"


def fields_by_word(word: str) -> list[str]:
    """The fields whose name holds `word` as a word (`lr`: optim.lr, optim.min_lr_ratio), else
    as part of one: what `--help WORD` shows when no field starts with WORD."""
    paths = [f.path for f in schema_fields()]
    word = word.lower()
    hits = [p for p in paths if word in re.split(r"[._\[\]]+", p.lower())]
    return hits or [p for p in paths if word in p.lower()]


def _resolve(prefixes: typing.Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(what to show: prefixes, and the fields a word search found; one line per word search;
    the prefixes that match nothing)."""
    paths = [f.path for f in schema_fields()]
    shown, notes, unknown = [], [], []
    for p in prefixes:
        if any(_matches(path, [p]) for path in paths):
            shown.append(p)
        elif hits := fields_by_word(p):
            shown += hits
            notes.append(
                f"no config field starts with {p}; the fields named with it: {', '.join(hits)}"
            )
        else:
            unknown.append(p)
    return shown, notes, unknown


def main(argv: typing.Sequence[str]) -> int:
    """`python train.py --help ...` (argv: train.py's arguments) and `python confhelp.py`."""
    args = [a for a in argv if a not in ("--help", "-h")]
    if "--write" in args:
        DOCS_PATH.write_text(render_markdown())
        print(f"wrote {DOCS_PATH.relative_to(ROOT)} ({len(schema_fields())} fields)")
        return 0
    if "--markdown" in args:
        sys.stdout.write(render_markdown())
        return 0
    overrides = [a for a in args if "=" in a]
    prefixes = [a for a in args if "=" not in a and not a.startswith("-")]
    shown, notes, unknown = _resolve(prefixes)  # `--help lr`: a word, not a prefix
    try:
        from overrides import check_overrides

        check_overrides(overrides)  # a wrong override: the line a run would give
        text = render_text(shown, overrides)
    except Exception as e:  # an override Hydra cannot compose: say so in one line
        print(f"error: --help {' '.join(overrides)}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if unknown:
        print(f"error: {no_field_line(unknown)}", file=sys.stderr)
        return 2
    said = [
        line for n in notes for line in textwrap.wrap(n, terminal_width(), subsequent_indent="  ")
    ]
    sys.stdout.write("".join(f"{line}\n" for line in said) + ("\n" if said else "") + text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
