"""Hugging Face weights in and out of training, on gloo processes (checkpoint/hf.py).

- init_from through train.py's run() on 2 processes (fsdp, tp; tied and untied): the step-1
  loss equals the HF model's loss on the trainer's own first batch;
- init_from into every layout on 4 processes, for the reference model and the CPU stand-in of
  the TE model (tests/test_parallel_matrix.py MockTELlama: TE's parameter names and TP
  wrapping): every gathered parameter equals the HF weights bit for bit;
- a run that resumes never reads the HF weights;
- the export command on a checkpoint trained with tp=2: transformers loads the folder and its
  logits equal our model's loaded from the same checkpoint in one process; tokenizer files.

All fp32 on CPU: the HF references differ from ours only by summation order.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from errors import ConfigError
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 300
TOL = 1e-5
COMMON = [
    "data.seq_len=64",
    "data.max_bytes=200000",
    "train.global_batch_size=4",
    "train.log_every=1",
]


def save_hf_model(path: Path, *, tied: bool, n_heads: int = 4, n_kv_heads: int = 2) -> Path:
    """A random LlamaForCausalLM saved by transformers itself (sharded safetensors), with
    Llama-3 RoPE scaling that acts at the tested lengths and random norm weights."""
    conf = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=tied,
    )
    torch.manual_seed(11)
    model = LlamaForCausalLM(conf).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(path, max_shard_size="150KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def load_hf(path: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()


def _train(rank, world_size, overrides):
    import train
    from config import compose_config

    assert train.run(compose_config(overrides)) == 0


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def first_batch_hf_loss(folder: Path, overrides: list[str]) -> float:
    """The HF model's mean next-token loss on the trainer's first global batch (the same
    loader, built here for one data-parallel rank)."""
    from config import compose_config
    from data import build_loader, build_tokenizer

    cfg = compose_config(overrides)
    batch = build_loader(
        cfg.data,
        build_tokenizer(cfg.data),
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=0,
        dp_size=1,
    ).next_batch()
    with torch.no_grad():
        logits = load_hf(folder)(batch[:, :-1]).logits[..., :VOCAB]
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_init_from_step1_loss_equals_hf(tmp_path, layout, tied):
    folder = save_hf_model(tmp_path / "hf", tied=tied)
    overrides = [
        *COMMON,
        "model=hf",
        f"model.init_from={folder}",
        f"parallel={layout}",
        "train.steps=1",
        "checkpoint=none",
        f"run.root={tmp_path}",
        "run.name=r",
    ]
    run_distributed(_train, 2, overrides)
    (record,) = metrics(tmp_path / "r")
    ref = first_batch_hf_loss(folder, overrides)
    diff = abs(record["loss"] - ref)
    print(f"\ninit_from {layout} {'tied' if tied else 'untied'}: step-1 loss {record['loss']:.6f}")
    print(f"  HF loss {ref:.6f}, |diff| {diff:.2e}")
    assert record["step"] == 1 and diff < TOL


# Every layout on 4 ranks: (ParallelConfig fields).
LAYOUTS = {
    "ddp": dict(name="ddp", dp_replicate=-1, dp_shard=1, tp=1),
    "fsdp": dict(name="fsdp", dp_replicate=1, dp_shard=-1, tp=1),
    "hsdp": dict(name="hsdp", dp_replicate=2, dp_shard=-1, tp=1),
    "tp": dict(name="tp", dp_replicate=1, dp_shard=1, tp=-1),
    "fsdp_tp": dict(name="fsdp_tp", dp_replicate=1, dp_shard=-1, tp=2),
    "hsdp_tp": dict(name="hsdp_tp", dp_replicate=2, dp_shard=-1, tp=2),
}


def _layouts_worker(rank, world_size, folder, out_path):
    from torch.distributed.tensor import DTensor

    import compat
    from checkpoint.hf import load_hf_weights, read_hf_config
    from config import validate_tp_split
    from model.config import ModelConfig
    from model.hf import from_hf_state_dict, model_config_for_hf
    from model.llama import Llama
    from parallel import ParallelConfig, ParallelDims, parallelize
    from tests.test_parallel_matrix import MockTELlama

    torch.set_num_threads(1)
    # full_tensor() of a strided FSDP x TP shard warns that it takes two all-gathers.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    compat.apply_all()
    base = ModelConfig(name="hf", init_from=folder, shape_from_hf=True, pad_vocab_multiple=64)
    cfg = model_config_for_hf(base, read_hf_config(folder))
    hf = load_hf(Path(folder))
    want = from_hf_state_dict(hf.state_dict(), cfg)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    report = {}
    for impl in ("torch", "te"):
        for layout, kw in LAYOUTS.items():
            pcfg = ParallelConfig(**kw)
            dims = ParallelDims(pcfg, world_size)
            validate_tp_split(cfg, dims.tp)
            dims.build_mesh("cpu")
            with torch.device("meta"):
                if impl == "te":
                    model = MockTELlama(cfg, tp_group=dims.tp_group, sequence_parallel=True)
                else:
                    model = Llama(cfg)
            model = parallelize(model, dims, pcfg, impl, mixed_precision=False)
            model.to_empty(device="cpu")
            model.reset_buffers()
            load_hf_weights(model, cfg, folder)
            for name, p in model.named_parameters():
                got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                assert torch.equal(got, want[name]), f"{impl} {layout}: {name}"
            with torch.no_grad():
                logits = model.eval()(tokens)[..., :VOCAB]
            report[f"{impl}/{layout}"] = (logits - hf_logits).abs().max().item()
    if rank == 0:
        Path(out_path).write_text(json.dumps(report))


@pytest.mark.slow
def test_init_from_every_layout_both_implementations(tmp_path):
    """4 ranks, so tp=4 needs 4 KV heads."""
    folder = save_hf_model(tmp_path / "hf", tied=False, n_heads=8, n_kv_heads=4)
    out = tmp_path / "report.json"
    run_distributed(_layouts_worker, 4, str(folder), str(out))
    report = json.loads(out.read_text())
    for case, diff in report.items():
        print(f"\ninit_from {case}: max abs logits diff vs HF {diff:.2e}")
    assert len(report) == 2 * len(LAYOUTS) and max(report.values()) < TOL


def _expect_config_error(rank, world_size, overrides, match):
    import train
    from config import compose_config

    with pytest.raises(ConfigError, match=match):
        train.run(compose_config(overrides))


@pytest.mark.slow
def test_resume_wins_over_init_from(tmp_path):
    """Once the run has a checkpoint, re-running it resumes and never reads the HF weights
    (here deleted: only config.json is left, which model=hf still reads for the shape)."""
    folder = save_hf_model(tmp_path / "hf", tied=False)
    run = [
        *COMMON,
        "model=hf",
        f"model.init_from={folder}",
        "checkpoint=sync",
        "checkpoint.interval=1",
        f"run.root={tmp_path}",
        "run.name=r",
        "optim.schedule_steps=2",  # one schedule for both segments
    ]
    run_distributed(_train, 1, [*run, "train.steps=1"])
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink()
    run_distributed(_train, 1, [*run, "train.steps=2"])
    assert [r["step"] for r in metrics(tmp_path / "r")] == [1, 2]
    # Starting over needs the weights again.
    run_distributed(
        _expect_config_error,
        1,
        [*run, "train.steps=2", "checkpoint.resume=none"],
        r"has no \*.safetensors",
    )


def test_init_from_config_errors(tmp_path):
    """Bad input is one line naming the field and the fix, before anything is built."""
    import train
    from config import compose_config

    folder = save_hf_model(tmp_path / "hf", tied=False)
    base = [*COMMON, "checkpoint=none", f"run.root={tmp_path}", "run.name=r"]
    with pytest.raises(ConfigError, match=r"model=hf takes the model shape from model.init_from"):
        train.run(compose_config([*base, "model=hf"]))
    with pytest.raises(ConfigError) as e:
        train.run(compose_config([*base, "model=tiny", f"model.init_from={folder}"]))
    msg = str(e.value)
    print(f"\n{msg}")
    assert "\n" not in msg and "model=hf" in msg
    assert "model.dim=128 (config.json: 64)" in msg and "model.tie_embeddings" not in msg
    assert not (tmp_path / "r").exists()


def _convert_tool():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_tp_checkpoint(tmp_path, tied, capsys):
    import torch.distributed.checkpoint as dcp
    import yaml
    from omegaconf import OmegaConf
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from checkpoint.planners import BlockLoadPlanner
    from checkpoint.state import ModelState
    from data.tokenizer import ByteTokenizer
    from model.config import ModelConfig
    from model.hf import to_hf_state_dict
    from model.llama import Llama

    overrides = [
        *COMMON,
        "model=tiny",
        "model.dim=64",
        "model.n_layers=2",
        "model.ffn_dim=96",
        f"model.tie_embeddings={tied}",
        "model.rope_scaling.original_max_position_embeddings=16",  # active at these lengths
        "model.max_seq_len=64",
        "parallel=tp",
        "train.steps=3",
        "checkpoint=sync",
        "checkpoint.interval=3",
        f"run.root={tmp_path}",
        "run.name=r",
    ]
    run_distributed(_train, 2, overrides)
    step = tmp_path / "r" / "checkpoints" / "step_0000003"
    fc1 = (
        FileSystemReader(str(step))
        .read_metadata()
        .state_dict_metadata["model.layers.0.layernorm_mlp.fc1_weight"]
    )
    assert len(fc1.chunks) == 4  # each tp rank saved [gate_r; up_r] as two row blocks
    out = tmp_path / "hf"
    tool = _convert_tool()
    assert tool.main(["export", str(step), str(out), "--max-shard-size", "100KB"]) == 0

    # Our model from the same checkpoint, one process, through the trainer's own load path.
    saved = yaml.safe_load((step / "config.yaml").read_text())
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"]))
    ours = Llama(cfg)
    dcp.load(
        {"model": ModelState(ours)},
        checkpoint_id=str(step),
        planner=BlockLoadPlanner(),
        no_dist=True,
    )
    hf = load_hf(out)
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(f))
    assert (
        len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    )
    want = to_hf_state_dict(ours.state_dict(), cfg)
    assert exported.keys() == want.keys()
    for k in want:
        assert torch.equal(exported[k], want[k]), k

    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (ours.eval()(tokens)[..., : cfg.vocab_size] - hf(tokens).logits).abs().max().item()
    with capsys.disabled():
        print(f"\nexport tp=2 {'tied' if tied else 'untied'}: max abs logits diff {diff:.2e}")
    assert diff < TOL

    # BOS / EOS and the byte tokenizer.
    ref = ByteTokenizer()
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (ref.bos_id, ref.eos_id)
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id) == (ref.bos_id, ref.eos_id)
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, PreTrainedTokenizerFast)
    text = "x = 'héllo wörld' # 日本 🙂"
    assert tok.encode(text) == ref.encode(text) and tok.decode(tok.encode(text)) == text

    # Bad input: one line, exit status 2, nothing written.
    capsys.readouterr()
    assert tool.main(["export", str(step), str(out)]) == 2
    assert tool.main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
    assert "not empty" in err[0] and "no committed checkpoint" in err[1]
    assert not (tmp_path / "x").exists()


def test_export_tokenizer_of_an_hf_run(tmp_path):
    """A run with an HF tokenizer: its files are saved as AutoTokenizer gives them."""
    from checkpoint.hf import byte_tokenizer, export_tokenizer

    byte_tokenizer(64).save_pretrained(tmp_path / "tok")  # stands in for a hub tokenizer
    tok, bos, eos = export_tokenizer(str(tmp_path / "tok"), 64)
    tok.save_pretrained(tmp_path / "out")
    again = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (bos, eos) == (256, 257) and again.encode("añb") == [97, 195, 177, 98]
    with pytest.raises(ConfigError, match=r"pass --tokenizer"):
        export_tokenizer(str(tmp_path / "missing"), 64)
