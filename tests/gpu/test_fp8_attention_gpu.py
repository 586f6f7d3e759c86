"""FP8 dot-product attention (recipe.fp8_attention) on one Hopper GPU with TransformerEngine 2.20.

    python -m pytest -m gpu tests/gpu/test_fp8_attention_gpu.py -q -s

1. Causality of TE's attention: te.DotProductAttention (causal, bshd, head_dim 128, 8 query and
   2 key/value heads, seq 512, bf16 inputs) trains 3 steps, so that its delayed scales are no
   longer the initial ones; then, under torch.no_grad (TE updates delayed scales when an
   autocast is left with grad enabled, and in backward: so both calls below use the same
   scales), out(q, k, v) and out(q2, k2, v2), where q2, k2, v2 equal q, k, v up to position t and
   are 1000 times larger after it, agree at positions <= t bit for bit: in bf16 (the property
   itself), under DelayedScaling(fp8_dpa=True) (recipe=fp8_delayed), and under
   Float8CurrentScaling(fp8_dpa=True) with NVTE_DPA_FP8_RECIPE=DelayedScaling (recipe=fp8_cs),
   whose attention recipe must equal `Recipe.attention_te_recipe()` (the one checkpoints load
   with). TE reads NVTE_DPA_FP8_RECIPE once, at import, and this process imported TE already:
   the fp8_cs cases run in a fresh interpreter started with the variables of
   recipes.attention_environment (`main` below).
2. Causality of the model: model.te_llama.TELlama (dim 256, 2 query heads of 128, 1 key/value
   head, 2 blocks) trains 3 steps, then the logits at positions <= t are compared with tokens
   after t changed. fp8_delayed + fp8_attention: equal bit for bit (asserted). fp8_cs +
   fp8_attention and bf16: the maximum difference is printed; under fp8_cs the Linear layers
   scale each activation tensor by its own amax over all positions, so the past may depend on
   the future there (nothing is asserted about its size).
3. train.py on the same shape (seq 256): 30 steps of fp8_delayed with and without FP8 attention
   end within 2% of each other (mean loss of steps 21-30), the FP8 runs use TE's FP8 fused
   attention (its debug log names sub-backend FP8), and a run resumed from step 4 to step 8
   repeats the uninterrupted run's losses, for fp8_delayed and fp8_cs with FP8 attention; the
   fp8_cs checkpoint holds the attention modules' delayed scaling ("te_scaling"). Bit for bit
   with train.deterministic=true where cuDNN >= 9.19 (TE's deterministic FP8 attention
   backward); with an older cuDNN deterministic mode is refused with FP8 attention, so those
   runs are nondeterministic and the losses must agree within RESUME_RTOL instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import te_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs a CUDA GPU and TransformerEngine"),
    pytest.mark.skipif(
        te_available() and torch.cuda.get_device_capability(0)[0] != 9,
        reason="FP8 attention as TE trains it on sm_90 (Hopper)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
#: Marks the result lines `main` prints in the fresh interpreter.
MARK = "fp8-attention-result: "
#: Attention level: batch, sequence, query heads, key/value heads, head_dim; the last position
#: kept (not on a 64- or 128-row tile boundary, so masked rows share a tile with kept ones).
B, S, HQ, HKV, D = 2, 512, 8, 2, 128
T_ATTENTION = 300
#: Model level: rows of 256 tokens, the last position kept.
ROWS, SEQ, T_MODEL = 4, 256, 150
#: Relative loss difference allowed between a nondeterministic resume and the run it repeats
#: (cuDNN < 9.19: no deterministic FP8 attention backward). A bound on kernel nondeterminism
#: over 4 steps, not a measured figure.
RESUME_RTOL = 1e-2


def _recipe(kind: str, n_layers: int):
    from recipes import RecipeConfig, build_recipe

    cfg = RecipeConfig() if kind == "bf16" else RecipeConfig(name=kind, fp8_attention=True)
    return build_recipe(cfg, n_layers)


def _fused_backend() -> int | None:
    """The fused-attention sub-backend TE selected last (its module's own record)."""
    module = sys.modules[
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
    ]
    chosen = module._attention_backends
    if not chosen.get("use_fused_attention"):
        return None
    return int(chosen["fused_attention_backend"])


def _fp8_backend() -> int:
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    return int(FusedAttnBackend["FP8"])


def attention_case(kind: str) -> dict:
    """Section 1 for one recipe kind (bf16, fp8_delayed, fp8_cs)."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    recipe = _recipe(kind, 1)
    dpa = te.DotProductAttention(
        HQ, D, num_gqa_groups=HKV, attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal"
    ).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def qkv() -> list[torch.Tensor]:
        shapes = [(B, S, HQ, D), (B, S, HKV, D), (B, S, HKV, D)]
        return [torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) for s in shapes]

    def attend(q, k, v) -> torch.Tensor:
        with recipe.autocast():  # bf16: no autocast
            return dpa(q, k, v)

    for _ in range(3):  # training steps: the delayed scales move off their initial 1.0
        q, k, v = (x.requires_grad_() for x in qkv())
        attend(q, k, v).float().square().mean().backward()
    q, k, v = qkv()
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, T_ATTENTION + 1 :] *= 1000
    with torch.no_grad():
        out, out2 = attend(q, k, v), attend(q2, k2, v2)
    kept, kept2 = out[:, : T_ATTENTION + 1], out2[:, : T_ATTENTION + 1]
    result = {
        "kind": kind,
        "equal": bool(torch.equal(kept, kept2)),
        "max_diff": (kept.float() - kept2.float()).abs().max().item(),
        "fused_backend": _fused_backend(),
        "fp8_backend": _fp8_backend(),
    }
    if recipe.is_quantized:
        meta = dpa.fp8_meta
        expected = recipe.attention_te_recipe() or recipe.te_recipe()
        result.update(
            recipe=repr(meta["recipe"]),
            recipe_matches=bool(meta["recipe"] == expected),
            scales_moved=bool(meta["scaling_fwd"].scale.ne(1).any().item()),
        )
    return result


def model_case(kind: str) -> dict:
    """Section 2 for one recipe kind: the largest logit difference at positions <= t."""
    from model.config import ModelConfig
    from model.init import init_weights
    from model.te_llama import TELlama

    cfg = ModelConfig(
        name="fp8-attention",
        dim=256,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=512,
        vocab_size=258,
        max_seq_len=SEQ,
    )
    torch.manual_seed(0)
    model = TELlama(cfg, recipe=_recipe(kind, cfg.n_layers), device="cuda")
    init_weights(model, cfg, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (ROWS, n), generator=gen, device="cuda")

    def bf16():
        return torch.autocast("cuda", dtype=torch.bfloat16)

    for _ in range(3):
        rows = tokens(SEQ + 1)
        with bf16():
            loss = model(rows[:, :-1], labels=rows[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    x = tokens(SEQ)
    x2 = x.clone()
    x2[:, T_MODEL + 1 :] = (x[:, T_MODEL + 1 :] + 1 + tokens(SEQ - T_MODEL - 1) % 100) % 258
    with torch.no_grad(), bf16():
        logits, logits2 = model(x), model(x2)
    kept, kept2 = logits[:, : T_MODEL + 1], logits2[:, : T_MODEL + 1]
    return {
        "kind": kind,
        "equal": bool(torch.equal(kept, kept2)),
        "max_diff": (kept.float() - kept2.float()).abs().max().item(),
        "fused_backend": _fused_backend(),
        "fp8_backend": _fp8_backend(),
    }


def main() -> None:
    """`python -c "from tests.gpu.test_fp8_attention_gpu import main; main()" attention:fp8_cs
    model:fp8_cs`: the cases in this interpreter, one result line each (MARK + JSON)."""
    for case in sys.argv[1:]:
        level, kind = case.split(":")
        result = attention_case(kind) if level == "attention" else model_case(kind)
        print(MARK + json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def fp8_cs_results() -> dict[str, dict]:
    """Sections 1 and 2 for fp8_cs + fp8_attention, in a fresh interpreter started with the
    NVTE_DPA_* variables a train.py run of that recipe sets (TE reads them at import)."""
    from recipes import RecipeConfig, attention_environment

    env = {
        **os.environ,
        **attention_environment([RecipeConfig(name="fp8_cs", fp8_attention=True)]),
        "PYTHONUNBUFFERED": "1",
    }
    code = "from tests.gpu.test_fp8_attention_gpu import main; main()"
    r = subprocess.run(
        [sys.executable, "-c", code, "attention:fp8_cs", "model:fp8_cs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x[len(MARK) :]) for x in r.stdout.splitlines() if x.startswith(MARK)]
    assert len(lines) == 2, r.stdout[-3000:]
    return {"attention": lines[0], "model": lines[1]}


# ---------------------------------------------------------------- 1. TE's attention


@pytest.mark.parametrize("kind", ["bf16", "fp8_delayed", "fp8_cs"])
def test_attention_output_before_t_ignores_positions_after_t(kind, fp8_cs_results):
    result = fp8_cs_results["attention"] if kind == "fp8_cs" else attention_case(kind)
    print(f"attention {kind}: {result}")
    assert result["equal"], f"{kind}: positions <= {T_ATTENTION} changed by {result['max_diff']}"
    if kind != "bf16":
        # FP8 attention ran (cuDNN's FP8 fused attention), under delayed scales that training
        # moved, and under fp8_cs with the recipe checkpoints load attention's scales with.
        assert result["fused_backend"] == result["fp8_backend"], result
        assert result["scales_moved"] and result["recipe_matches"], result
        assert result["recipe"].startswith("recipe_type=DelayedScaling"), result["recipe"]


# ---------------------------------------------------------------- 2. the model


def test_model_logits_before_t_ignore_tokens_after_t(fp8_cs_results):
    delayed = model_case("fp8_delayed")
    bf16 = model_case("bf16")
    cs = fp8_cs_results["model"]
    for r in (delayed, bf16, cs):
        print(f"model {r['kind']}: logits at positions <= {T_MODEL} max |diff| {r['max_diff']:.3g}")
    assert delayed["fused_backend"] == delayed["fp8_backend"], delayed
    assert cs["fused_backend"] == cs["fp8_backend"], cs
    assert delayed["equal"], f"fp8_delayed + fp8_attention: the past moved by {delayed['max_diff']}"


# ---------------------------------------------------------------- 3. train.py

RUN = [
    "model.dim=256",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=512",
    "data.seq_len=256",
    "data.max_bytes=400000",
    "data.document_mask=false",
    "train.global_batch_size=8",
    "train.log_every=1",
    "train.device=cuda",
    "optim.warmup_steps=5",
    "optim.schedule_steps=30",  # the resumed runs stop at 8 with the same schedule
    "resume.loss_check=off",
]
#: TE logs the attention backend it selects (INFO).
TE_LOG = {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "1"}


def _deterministic() -> bool:
    import recipes

    version = recipes.cudnn_version()
    return version is not None and tuple(version) >= (9, 19, 0)


def _train(root: Path, name: str, *extra: str) -> tuple[dict[int, float], str]:
    from runlog import read_metrics
    from runtime import launch

    r = launch([*RUN, f"run.root={root}", f"run.name={name}", *extra], env=TE_LOG, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    records = read_metrics(root / name / "metrics.jsonl")
    return {int(x["step"]): float(x["loss"]) for x in records if "loss" in x}, out


def test_fp8_attention_trains_like_bf16_attention(tmp_path):
    fp8, out = _train(tmp_path, "attention", "recipe=fp8_delayed", "recipe.fp8_attention=true",
                      "train.steps=30", "checkpoint=none")  # fmt: skip
    assert f"FusedAttention backend (sub-backend {_fp8_backend()})" in out, out[-4000:]
    plain, _ = _train(tmp_path, "plain", "recipe=fp8_delayed", "train.steps=30", "checkpoint=none")
    last = range(21, 31)
    a, b = (sum(losses[s] for s in last) / len(last) for losses in (fp8, plain))
    print(f"fp8_delayed, steps 21-30: mean loss {a:.4f} with FP8 attention, {b:.4f} without")
    assert abs(a - b) <= 0.02 * b, (a, b)


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_cs"])
def test_resume_repeats_the_run(recipe, tmp_path):
    deterministic = _deterministic()
    common = [f"recipe={recipe}", "recipe.fp8_attention=true",
              f"train.deterministic={str(deterministic).lower()}"]  # fmt: skip
    full, out = _train(tmp_path, "full", *common, "train.steps=8", "checkpoint.interval=4",
                       "checkpoint.keep_last=4")  # fmt: skip
    assert f"FusedAttention backend (sub-backend {_fp8_backend()})" in out, out[-4000:]
    ckpt = tmp_path / "full" / "checkpoints" / "step_0000004"
    if recipe == "fp8_cs":  # the attention modules' delayed scaling is in the checkpoint
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        scaling = sorted({k.rsplit(".", 1)[0] for k in keys if k.startswith("te_scaling.")})
        assert scaling and all(k.endswith("core_attention") for k in scaling), scaling
    resumed, _ = _train(tmp_path, "resumed", *common, "train.steps=8",
                        f"checkpoint.resume={ckpt}")  # fmt: skip
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    pairs = [(full[s], resumed[s]) for s in range(5, 9)]
    print(f"{recipe} + fp8_attention, deterministic={deterministic}: steps 5-8 {pairs}")
    if deterministic:
        assert all(a == b for a, b in pairs), pairs
    else:
        assert all(abs(a - b) <= RESUME_RTOL * abs(a) for a, b in pairs), pairs
