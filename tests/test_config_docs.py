"""The config reference (confhelp.py) against the schema: every field described, the generated
docs/CONFIGURATION.md current, and `python train.py --help` printing it."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

import confhelp
from config import Config
from runtime import launch

ROOT = Path(__file__).resolve().parents[1]


def _leaf_paths(cls: type, prefix: str = "") -> set[str]:
    """The schema's field paths, walked independently of confhelp: dataclass fields of the
    root's group nodes and of any nested dataclass."""
    import typing

    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        args = typing.get_args(tp)
        inner = next((a for a in (tp, *args) if dataclasses.is_dataclass(a)), None)
        if inner is not None and prefix == "":
            out |= _leaf_paths(inner, path + ".")
            continue
        out.add(path)
        if inner is not None:
            sep = "[]." if typing.get_origin(tp) is list else "."
            out |= _leaf_paths(inner, path + sep)
    return out


def test_every_schema_field_is_listed_once():
    paths = [f.path for f in confhelp.schema_fields()]
    assert len(paths) == len(set(paths))
    assert set(paths) == _leaf_paths(Config)


def test_every_field_has_a_description():
    missing = confhelp.undocumented()
    assert not missing, (
        "config fields without a description: "
        + ", ".join(missing)
        + ". Add a `#:` comment line right above each field in its dataclass (units, allowed "
        f"values), then run `{confhelp.REGENERATE}`"
    )


def test_field_comments_are_read_from_the_source():
    from config import TrainConfig

    docs = confhelp.field_comments(TrainConfig)
    assert docs["global_batch_size"] == "Sequences per optimizer step over all data-parallel ranks."
    # a two-line comment is joined into one line
    assert docs["micro_batch_size"] == (
        "Sequences per forward/backward on one rank; the rest is gradient accumulation. "
        "null: the whole per-rank share of the global batch (no accumulation)."
    )


def test_defaults_are_the_composed_config():
    """Defaults come from what `python train.py` composes (conf/ merged into the schema), not
    the bare dataclass defaults: checkpoint.mode's dataclass default is none, conf picks sync."""
    from config import compose_config

    cfg = compose_config()
    by_path = {f.path: f for f in confhelp.schema_fields()}
    assert by_path["checkpoint.mode"].default == cfg.checkpoint.mode == "sync"
    assert by_path["train.steps"].default == cfg.train.steps
    assert by_path["data.seq_len"].default == cfg.data.seq_len
    assert by_path["run.name"].default == "${model.name}-${recipe.name}-${parallel.name}"
    other = {f.path: f for f in confhelp.schema_fields(confhelp.composed_defaults(["data=hf"]))}
    assert other["data.seq_len"].default == compose_config(["data=hf"]).data.seq_len


def test_group_options_are_the_conf_files():
    options = confhelp.group_options()
    for group, opts in options.items():
        files = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        assert [name for name, _ in opts] == files
    assert dict(options["recipe"])["fp8_cs"] == (
        "FP8 with per-tensor current scaling (amax of the tensor being cast)."
    )
    assert confhelp.default_options()["model"] == "tiny"


def test_configuration_md_is_current():
    current = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    assert current == confhelp.render_markdown(), (
        "docs/CONFIGURATION.md is not what the config schema generates (a field, a `#:` comment, "
        f"a default or a conf/ option changed); run `{confhelp.REGENERATE}` and commit the result"
    )


def _train_help(*args: str) -> subprocess.CompletedProcess:
    # wide enough for a description beside its field
    return launch(list(args), env={"COLUMNS": "100"}, timeout=300)


def test_train_help_prints_the_field_reference():
    out = _train_help("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    cp = next(i for i, line in enumerate(lines) if line.lstrip().startswith("parallel.cp = 1 "))
    described = " ".join(" ".join(lines[cp : cp + 3]).split())
    assert "Context parallelism: each sequence is split over this many ranks" in described
    assert any(
        line.startswith("recipe: recipe={bf16 (default), fp8_block, fp8_cs") for line in lines
    )
    assert "Hydra" not in out.stdout.split("\n", 1)[0]  # our text, not Hydra's stock help
    assert "== Config ==" not in out.stdout


def test_train_help_narrows_and_takes_overrides():
    out = _train_help("-h", "model", "model=llama3_8b")
    assert out.returncode == 0, out.stderr
    fields = re.findall(r"^  (\S+) = ", out.stdout, flags=re.M)
    assert fields and all(f.startswith("model.") for f in fields)
    assert "  model.dim = 4096 " in out.stdout
    bad = _train_help("--help", "nosuchgroup")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: no config field starts with nosuchgroup"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no headings in code blocks
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_and_docs_links_resolve():
    """Every relative link of README.md and docs/*.md names a file of the repo, and its
    #anchor a heading of that file."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def _help(capsys, monkeypatch, *args: str, columns: int = 100) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    status = confhelp.main(["--help", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_help_wraps_to_the_terminal_and_keeps_every_word(capsys, monkeypatch):
    """Lines fit the terminal's width ($COLUMNS here), wide or narrow, and wrapping drops no
    word: the text of every field's description is there, in order."""
    for columns in (72, 120):
        status, out, _ = _help(capsys, monkeypatch, columns=columns)
        assert status == 0
        longest = max(out.splitlines(), key=len)
        assert len(longest) <= columns, longest
        flat = " ".join(out.split())
        for f in confhelp.schema_fields():
            assert f"{f.path} = {' '.join(f.shown_default.split())}" in flat, f.path
            assert " ".join(f.doc.split()) in flat, f.path


def test_help_names_sweeps_and_the_composed_config(capsys, monkeypatch):
    _, out, _ = _help(capsys, monkeypatch)
    assert "python train.py -m optim.lr=1e-3,3e-3" in out and "python train.py --cfg job" in out


def test_help_answers_a_wrong_prefix_or_option_in_one_line(capsys, monkeypatch):
    status, out, err = _help(capsys, monkeypatch, "train.stps")
    assert status == 2 and not out
    assert err == "error: no config field starts with train.stps; did you mean train.steps?\n"
    status, out, err = _help(capsys, monkeypatch, "model=llama3-1b")
    assert status == 2 and not out
    assert err == (
        "error: --help model=llama3-1b: model: no option 'llama3-1b'; choose one of hf, "
        "llama3_1b, llama3_3b, llama3_70b, llama3_8b, small, tiny (files of conf/model/)\n"
    )


def test_help_finds_fields_by_word_when_no_field_starts_with_it(capsys, monkeypatch):
    """`--help lr` and `--help batch`: no field starts with them, so the fields whose name
    holds the word are shown, under one line that says so."""
    for word, found in (
        ("lr", ["optim.lr", "optim.min_lr_ratio"]),
        ("batch", ["train.global_batch_size", "train.micro_batch_size"]),
    ):
        status, out, err = _help(capsys, monkeypatch, word, columns=200)
        assert status == 0 and not err
        assert out.splitlines()[0] == (
            f"no config field starts with {word}; the fields named with it: {', '.join(found)}"
        )
        shown = re.findall(r"^  ([a-z_]+\.[a-z_.]+) = ", out, flags=re.M)
        assert shown == found, out


def _code_constants() -> set[str]:
    """Module-level UPPER_CASE names (with an underscore) of the project's Python files."""
    import ast

    names = set()
    for path in ROOT.glob("**/*.py"):
        if {".venv", "tests", "build"} & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            names |= {
                t.id
                for t in targets
                if isinstance(t, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+", t.id)
            }
    return names


def test_help_names_no_code_constants_and_its_pointers_resolve():
    """User text (every field's help) names no constant of the code (a user cannot look up
    `RESUME_FREE`), and each pointer to a page's section, `(docs/RUNS.md, Determinism)` or
    `(README, ...)`, names a heading that exists."""
    text = "\n".join(f.doc for f in confhelp.schema_fields())
    constants = _code_constants()
    assert "RUNLOCK" not in constants and len(constants) > 20  # the scan finds them
    assert not [c for c in constants if re.search(rf"\b{c}\b", text)]
    pointers = re.findall(r"\((README|docs/[A-Z_]+\.md), ([A-Z][^,;)]*)\)", text)
    assert pointers
    for page, heading in pointers:
        path = ROOT / ("README.md" if page == "README" else page)
        assert _anchor(heading) in _anchors(path), f"({page}, {heading}): no such heading"


def test_configuration_md_example_is_what_the_option_sets():
    """CONFIGURATION.md's example of a group option changing a default is what composing
    that option gives."""
    from config import compose_config

    text = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    m = re.search(r"for example `(\w+)=(\w+)` sets `(\w+)\.(\w+)` to\s+(\S+?)\)", text)
    assert m, "no example sentence"
    group, option, section, key, value = m.groups()
    got = getattr(getattr(compose_config([f"{group}={option}"]), section), key)
    assert str(got) == value and getattr(getattr(compose_config(), section), key) != got


def test_readme_example_outputs_are_git_ignored():
    """What the README's commands write into the checkout (an export folder, a plot) is
    ignored by git, so following the README leaves `git status` clean."""
    text = (ROOT / "README.md").read_text()
    outputs = re.findall(r"convert_hf\.py export \S+ (\S+)", text)
    outputs += re.findall(r"--plot (\S+)", text)
    assert "out/hf" in outputs and "cmp.png" in outputs, outputs
    for path in outputs:
        r = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, capture_output=True
        )
        assert r.returncode == 0, f"{path} (written by a README command) is not git-ignored"


@pytest.mark.parametrize(
    "group, opening",
    [
        ("model", "`model=` picks a shape ("),
        ("recipe", "`recipe=` the precision ("),
        ("parallel", "`parallel=` picks the layout ("),
    ],
)
def test_readme_lists_every_option_of_a_group(group, opening):
    """The README's list of a config group's options names each file of conf/<group>/ (issue
    #53: llama3_3b was left out), and nothing else."""
    text = " ".join((ROOT / "README.md").read_text().split())
    assert opening in text, opening
    listed = text[text.index(opening) + len(opening) :].split(";")[0].split(")")[0]
    names = {n for n in re.findall(r"`(\w+)`", listed)}
    assert names == {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}, listed
