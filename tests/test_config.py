"""Config composition and bad input: every wrong configuration fails with one clear line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from config import ConfigError, compose_config
from runtime import launch

ROOT = Path(__file__).resolve().parents[1]


def load(*overrides: str):
    return compose_config(overrides)


def check(*overrides: str, world_size: int = 1):
    from train import check_config

    return check_config(load(*overrides), world_size, torch.device("cpu"))


def test_default_composes_and_validates():
    cfg = load()
    assert (cfg.model.name, cfg.recipe.name, cfg.parallel.name) == ("tiny", "bf16", "fsdp")
    assert cfg.run.name == "tiny-bf16-fsdp"
    dims, grad_accum, impl = check()
    assert impl == "torch" and grad_accum == 1 and dims.dp_size == 1


@pytest.mark.parametrize(
    "group,options",
    [
        ("model", ["tiny", "small", "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b"]),
        ("recipe", ["bf16", "fp8_delayed", "fp8_cs", "fp8_block", "mxfp8", "nvfp4"]),
        ("parallel", ["ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "hsdp_tp"]),
        ("checkpoint", ["none", "sync", "async", "async_process"]),
        ("data", ["embedded", "hf"]),
        ("logger", ["default", "wandb"]),
    ],
)
def test_every_group_option_composes(group, options):
    for option in options:
        cfg = load(f"{group}={option}")
        node = getattr(cfg, group)
        if hasattr(node, "name"):
            assert node.name == option


def test_llama3_shapes():
    cfg = load("model=llama3_8b")
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (
        4096,
        32,
        32,
        8,
        14336,
        128256,
    )
    assert m.padded_vocab_size == 128256 and m.rope_scaling.factor == 8.0
    assert load("model=llama3_1b").model.tie_embeddings
    assert load("model=llama3_70b").model.n_layers == 80
    m = load("model=llama3_3b").model  # Llama 3.2 3B
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (
        3072,
        28,
        24,
        8,
        8192,
        128256,
    )
    assert m.tie_embeddings and m.rope_scaling.factor == 32.0 and m.max_seq_len == 131072
    # head_dim 128, the one TE trains FP8 attention with on sm_90 (llama3_1b: 64).
    assert [load(f"model={n}").model.head_dim for n in ("llama3_1b", "llama3_3b")] == [64, 128]
    assert load("model=llama3_8b").model.head_dim == load("model=llama3_70b").model.head_dim == 128


def test_big_composition_from_issue():
    cfg = load(
        "model=llama3_8b", "recipe=fp8_cs", "parallel=hsdp_tp", "checkpoint=async", "data=hf"
    )
    assert cfg.checkpoint.mode == "async" and cfg.parallel.tp == 2 and cfg.data.name == "hf"


# (overrides, world_size, expected substring of the one-line message)
BAD = [
    (["optim.lr=-1"], 1, "optim.lr=-1.0 must be > 0"),
    (["data.seq_len=4096"], 1, "data.seq_len=4096 exceeds model.max_seq_len=2048"),
    (
        ["train.global_batch_size=10", "train.micro_batch_size=4"],
        1,
        "train.global_batch_size=10 must be divisible by train.micro_batch_size=4",
    ),
    (
        ["train.global_batch_size=6"],
        4,
        "train.global_batch_size=6 must be divisible by the data-parallel size 4",
    ),
    (
        ["train.global_batch_size=8", "train.micro_batch_size=3"],
        2,
        "train.global_batch_size=8 must be divisible by train.micro_batch_size=3 x data-parallel size 2",
    ),
    (["model.impl=te"], 1, "model.impl=te needs a CUDA GPU and transformer_engine"),
    (
        ["recipe=fp8_cs", "model.impl=torch"],
        1,
        "on CPU, which runs recipe=bf16 only: use recipe=bf16",
    ),
    (["recipe=mxfp8"], 1, "recipe=mxfp8 needs"),
    (["model.n_heads=3"], 1, "model.dim=128 must be divisible by model.n_heads=3"),
    (["model.n_kv_heads=3"], 1, "model.n_heads=4 must be divisible by model.n_kv_heads=3"),
    (["optim.warmup_steps=-5"], 1, "optim.warmup_steps=-5 must be >= 0"),
    (["optim.moment_dtype=fp16"], 1, "optim.moment_dtype='fp16' is not one of fp32, bf16"),
    (
        ["optim.moment_dtype=bf16", "model.impl=torch"],
        1,
        "optim.moment_dtype=bf16 needs TE's FusedAdam (model.impl=te)",
    ),
    (
        ["parallel.keep_gathered_blocks=-1"],
        1,
        "parallel.keep_gathered_blocks=-1 must be >= 0",
    ),
    (["checkpoint.mode=sometimes"], 1, "checkpoint.mode='sometimes' is not one of"),
    (["logger.wandb.mode=maybe"], 1, "logger.wandb.mode='maybe' is not one of"),
    (["data=hf"], 1, "data.path is required with data=hf"),
    (
        ["data=synthetic", "data.seq_len=256", "data.doc_len_dist=normal"],
        1,
        "data.doc_len_dist='normal' is not one of fixed, exponential, lognormal, whole_rows; "
        "set data.doc_len_dist to one of them",
    ),
    (
        [
            "data=synthetic",
            "data.seq_len=256",
            "data.doc_len_dist=lognormal",
            "data.doc_len_sigma=0",
        ],
        1,
        "data.doc_len_sigma=0.0 must be > 0 with data.doc_len_dist=lognormal",
    ),
    (
        ["data=synthetic", "data.seq_len=256", "model.vocab_size=2"],
        1,
        "model.vocab_size=2 is too small for data=synthetic",
    ),
    (["data.min_doc_len=-1"], 1, "data.min_doc_len=-1 must be >= 0"),
    (
        ["data=synthetic", "data.seq_len=256", "data.min_doc_len=4096"],
        1,
        "data.min_doc_len=4096 joins the files of data=embedded, not data=synthetic; set "
        "data.min_doc_len=0 (long synthetic documents: data.doc_len_dist)",
    ),
    (["model.impl=jax"], 1, "model.impl='jax' is not one of auto, te, torch"),
    (["parallel=hsdp"], 1, "parallel"),
    (["parallel=tp", "parallel.tp=3"], 4, "parallel.tp"),
    (["parallel=tp", "model.n_kv_heads=1"], 2, "n_kv_heads"),
]


@pytest.mark.parametrize("overrides,world_size,message", BAD)
def test_bad_config_one_line(overrides, world_size, message):
    with pytest.raises(ConfigError) as err:
        check(*overrides, world_size=world_size)
    text = str(err.value)
    assert message in text, text
    assert "\n" not in text


def test_tp2_on_two_ranks_is_valid():
    dims, _, _ = check("parallel=tp", world_size=2)
    assert dims.tp == 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=foo"], "Could not find 'model/foo'"),
        (["model.dim=abc"], "model.dim"),
        (["model.typo=1"], "typo"),
        (["train.steps=1.5"], "train.steps"),
    ],
)
def test_hydra_rejects_unknown_option_key_and_type(overrides, message):
    with pytest.raises((HydraException, OmegaConfBaseException)) as err:
        load(*overrides)
    assert message in str(err.value)


def run_cli(*overrides: str) -> subprocess.CompletedProcess:
    return launch(
        [*overrides, "run.root=/nonexistent-never-created"],
        env={"CUDA_VISIBLE_DEVICES": "", "HYDRA_FULL_ERROR": "0"},
        timeout=300,
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optim.lr=-1"], "error: optim.lr=-1.0 must be > 0"),
        (["recipe=fp8_cs"], "error: recipe=fp8_cs needs"),
        (["model=foo"], "error: model: no option 'foo'; choose one of hf, llama3_1b"),
        (
            ["recipe.fp8_attention=true"],
            "error: recipe.fp8_attention=true has no effect with recipe=bf16 (nothing runs in "
            "FP8); drop recipe.fp8_attention or pick an FP8 recipe (fp8_delayed, fp8_cs, mxfp8, "
            "nvfp4)",
        ),
    ],
)
def test_cli_bad_input_one_line_no_traceback(overrides, message):
    r = run_cli(*overrides)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert message in lines[0], r.stderr
    assert len(lines) == 1, r.stderr
    assert r.returncode == 2
    assert not Path("/nonexistent-never-created").exists()


#: Values that were accepted without a word (issue 28): each is one line naming the field.
SILENT_BEFORE = [
    (
        ["checkpoint.interval=0", "checkpoint.save_at_end=false"],
        "checkpoint.interval=0 with checkpoint.save_at_end=false never saves a checkpoint "
        "(checkpoint=sync); set checkpoint.interval>0 or checkpoint.save_at_end=true, or use "
        "checkpoint=none",
    ),
    (["optim.schedule_steps=1"], "optim.schedule_steps=1 must be >= 2"),
    (["model.init_std=-0.02"], "model.init_std=-0.02 must be > 0"),
    (["model.norm_eps=0"], "model.norm_eps=0.0 must be > 0 (RMSNorm divides by it)"),
    (["train.peak_tflops=-5"], "train.peak_tflops=-5.0 must be > 0"),
    (["train.peak_tflops=0"], "train.peak_tflops=0.0 must be > 0"),
    (
        ["checkpoint=none", "checkpoint.resume=auto"],
        "checkpoint.resume=auto with checkpoint=none: a run that saves no checkpoints has none "
        "of its own to resume",
    ),
]


@pytest.mark.parametrize("overrides,message", SILENT_BEFORE)
def test_values_accepted_silently_before_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        check(*overrides)
    text = str(err.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_neighbours_of_the_refused_values_still_pass():
    check("optim.schedule_steps=2", "optim.warmup_steps=0")
    check("checkpoint.interval=0")  # saves at the end
    check("checkpoint.save_at_end=false")  # saves every interval
    check("checkpoint=none")  # resume: none
    check("checkpoint=none", "checkpoint.resume=/some/step_0000010")  # start from it, no saves
    check("train.peak_tflops=989")
    check(
        "checkpoint=sync",
        "checkpoint.interval=0",
        "checkpoint.save_at_end=false",
        "recipe.switch=[{at: 2, bf16_layers: [0]}]",
        "train.steps=4",
    )
