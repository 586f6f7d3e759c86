"""data=hf's inputs are checked before anything is built, in this order, one line each: the
local data.path, then the tokenizer, which is found in the local Hugging Face cache before
any network call (so an offline machine with the tokenizer cached trains, and one without it
stops at once instead of retrying downloads); choosing data=hf keeps data.seq_len."""

from __future__ import annotations

import json
import time

import pytest

from config import compose_config
from runtime import launch
from tests.helpers import CPU_ENV, TINY_RUN
from tests.test_data import make_local_tokenizer

#: An endpoint nothing listens on: any network call fails at once.
NO_HUB = "http://127.0.0.1:9"


def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    words = "the cat sat on the mat a dog ate the bone hello world again".split()
    with open(path, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": " ".join(words[(i + k) % len(words)] for k in range(9))}))
            f.write("\n")
    return path


def hub_cache(home, repo="acme/tok", revision="0123abcd"):
    """`repo`'s tokenizer files laid out as huggingface_hub's cache keeps a download."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    make_local_tokenizer(root / "snapshots" / revision)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)
    return repo


def one_line(r) -> str:
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    return lines[0]


def test_missing_path_first(tmp_path):
    # The path is named (not the tokenizer, which is not even looked at: offline, uncached).
    r = launch(
        ["data=hf", "data.path=data/my_corpus.jsonl", f"run.root={tmp_path}"],
        env={**CPU_ENV, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")},
        timeout=300,
    )
    assert one_line(r).startswith(
        "error: data.path='data/my_corpus.jsonl' does not exist (relative paths start at "
    )


def test_a_missing_folder_is_named_at_once_and_never_tried_on_the_hub(tmp_path, monkeypatch):
    """A path that looks local (a trailing slash, a folder ahead of it, `./`) and does not
    exist says so; a bare name not cached while the hub cannot be reached says that, at once
    (no half minute of download retries)."""
    from huggingface_hub import constants

    from data.config import DataConfig
    from data.sources import check_source
    from errors import ConfigError

    (tmp_path / "texts").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", NO_HUB)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def refusal(path):
        t0 = time.perf_counter()
        with pytest.raises(ConfigError) as e:
            check_source(DataConfig(name="hf", path=path))
        assert time.perf_counter() - t0 < 5
        return str(e.value)

    for path in ("my_texts/", "texts/my_texts", "./my_texts", "my texts"):
        assert refusal(path) == (
            f"data.path={path!r} does not exist (relative paths start at {tmp_path}); give an "
            "existing file, directory or glob of .json/.jsonl/.parquet/.txt files, or a hub "
            "dataset name"
        )
    assert refusal("my_texts") == (
        f"data.path='my_texts' is no local file or folder (relative paths start at {tmp_path}) "
        f"and, as a hub dataset name, is not in the local cache while {NO_HUB} cannot be "
        "reached (ConnectionRefusedError: Connection refused); give an existing file, "
        "directory or glob of data files, or download the dataset where there is network"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "is not in the local cache while downloads are off (HF_HUB_OFFLINE=1); " in refusal(
        "someorg/my_texts"
    )
    # A name the datasets cache may hold is left to `datasets` (it loads cached data offline).
    (tmp_path / "datasets" / "someorg___my_texts").mkdir(parents=True)
    check_source(DataConfig(name="hf", path="someorg/my_texts"))


@pytest.mark.parametrize(
    "env, says",
    [
        ({"HF_HUB_OFFLINE": "1"}, "and downloads are off (HF_HUB_OFFLINE=1);"),
        ({"HF_ENDPOINT": NO_HUB}, f"and {NO_HUB} cannot be reached (ConnectionRefusedError"),
    ],
)
def test_uncached_tokenizer_offline_is_one_line_at_once(tmp_path, env, says):
    t0 = time.perf_counter()
    r = launch(
        ["data=hf", f"data.path={corpus(tmp_path)}", f"run.root={tmp_path / 'runs'}"],
        env={**CPU_ENV, "HF_HOME": str(tmp_path / "home"), **env},
        timeout=300,
    )
    line = one_line(r)
    assert line.startswith(
        "error: data.tokenizer='meta-llama/Llama-3.2-1B' is not in the local Hugging Face cache"
    ), line
    assert says in line and "data.tokenizer=PATH" in line and "data.tokenizer=byte" in line
    assert "Retrying" not in r.stderr and not (tmp_path / "runs").exists()
    # No retries: process start-up (imports) plus a failed connection. A download attempt
    # with huggingface_hub's retries took about a minute.
    assert time.perf_counter() - t0 < 45


@pytest.mark.slow
def test_cached_tokenizer_trains_without_network(tmp_path):
    """A hub name found in the cache loads with no network call at all: the endpoint refuses
    every connection, and the run trains."""
    repo = hub_cache(tmp_path / "home")
    r = launch(
        [
            *TINY_RUN,
            "data=hf",
            f"data.path={corpus(tmp_path)}",
            f"data.tokenizer={repo}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=2",
            "checkpoint=none",
            f"run.root={tmp_path / 'runs'}",
        ],
        env={**CPU_ENV, "HF_HOME": str(tmp_path / "home"), "HF_ENDPOINT": NO_HUB},
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "step      2/2 | loss " in r.stdout


def test_choosing_hf_keeps_seq_len():
    assert compose_config(["data=hf"]).data.seq_len == compose_config([]).data.seq_len == 256
    assert compose_config(["data=hf", "data.seq_len=128"]).data.seq_len == 128
