"""Reference model (model/llama.py): seeded init, meta-device construction, RoPE, causality,
the fused interleaved QKV layout."""

import math

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig, RopeScalingConfig
from model.hf import hf_config
from model.init import init_std, init_weights
from model.llama import Llama, interleave_qkv, rms_norm, split_qkv
from model.rope import apply_rope, inv_frequencies

QKV = "self_attention.layernorm_qkv.weight"


def small_cfg(**kw) -> ModelConfig:
    base = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=300, max_seq_len=64
    )
    return ModelConfig(**{**base, **kw})


def seeded(cfg: ModelConfig, seed: int) -> Llama:
    model = Llama(cfg)
    init_weights(model, cfg, seed)
    return model


def tokens(cfg: ModelConfig, seed: int = 0, shape=(2, 32)) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_init_is_deterministic_by_seed():
    cfg = small_cfg()
    a, b, c = seeded(cfg, 7).state_dict(), seeded(cfg, 7).state_dict(), seeded(cfg, 8).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        if k.endswith(("norm_weight", "norm.weight")):
            assert torch.equal(a[k], torch.ones_like(a[k])), k
        else:
            assert not torch.equal(a[k], c[k]), k
    # Parameters of the same shape still get different values (per-name seeds).
    assert not torch.equal(a[f"layers.0.{QKV}"], a[f"layers.1.{QKV}"])


def test_init_std_follows_config():
    cfg = small_cfg(dim=256, n_heads=4, ffn_dim=512, n_layers=8)
    sd = seeded(cfg, 0).state_dict()
    assert sd["embed.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.05)
    out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    assert sd["layers.3.layernorm_mlp.fc2_weight"].std().item() == pytest.approx(out_std, rel=0.05)
    assert sd["layers.3.self_attention.proj.weight"].std().item() == pytest.approx(
        out_std, rel=0.05
    )
    # The fused QKV weight is an input projection: plain init_std for Q, K and V alike.
    q, k, v = split_qkv(sd[f"layers.3.{QKV}"], cfg.n_heads, cfg.n_kv_heads)
    for t in (q, k, v):
        assert t.std().item() == pytest.approx(cfg.init_std, rel=0.05)


def test_init_std_name_rules():
    cfg = small_cfg(n_layers=8)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    # "layernorm_qkv.weight" contains "norm" but is neither a norm weight nor an output proj.
    assert init_std(cfg, f"layers.0.{QKV}") == cfg.init_std
    assert init_std(cfg, "_orig_mod.layers.7.self_attention.layernorm_qkv.weight") == cfg.init_std
    assert init_std(cfg, "layers.0.self_attention.layernorm_qkv.layer_norm_weight") is None
    assert init_std(cfg, "layers.0.layernorm_mlp.layer_norm_weight") is None
    assert init_std(cfg, "norm.weight") is None
    assert init_std(cfg, "layers.0.self_attention.proj.weight") == out_std
    assert init_std(cfg, "layers.0.layernorm_mlp.fc2_weight") == out_std
    assert init_std(cfg, "layers.0.layernorm_mlp.fc1_weight") == cfg.init_std


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_meta_construction_matches_eager(tied):
    cfg = small_cfg(tie_embeddings=tied)
    eager = seeded(cfg, 3)
    with torch.device("meta"):
        lazy = Llama(cfg)
    assert all(p.is_meta for p in lazy.parameters()) and lazy.freqs.is_meta
    lazy.to_empty(device="cpu")
    init_weights(lazy, cfg, 3)
    lazy.reset_buffers()

    assert list(lazy.state_dict()) == list(eager.state_dict())
    for k, v in eager.state_dict().items():
        assert torch.equal(lazy.state_dict()[k], v), k
    assert torch.equal(lazy.freqs, eager.freqs)
    x = tokens(cfg)
    with torch.no_grad():
        assert torch.equal(lazy(x), eager(x))


def test_parameter_names_and_shapes():
    cfg = small_cfg()
    shapes = {k: tuple(v.shape) for k, v in Llama(cfg).state_dict().items()}
    hd, v = cfg.head_dim, cfg.padded_vocab_size
    assert v == 384
    assert shapes["embed.weight"] == (v, cfg.dim)
    assert shapes["lm_head.weight"] == (v, cfg.dim)
    assert shapes[f"layers.1.{QKV}"] == ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim)
    assert shapes["layers.1.layernorm_mlp.fc1_weight"] == (2 * cfg.ffn_dim, cfg.dim)
    assert len(shapes) == 3 + 6 * cfg.n_layers
    assert "lm_head.weight" not in Llama(small_cfg(tie_embeddings=True)).state_dict()


@pytest.mark.parametrize(
    "scaling",
    [
        RopeScalingConfig(),  # Llama 3.1: factor 8 over 8192 positions
        RopeScalingConfig(factor=32.0, original_max_position_embeddings=8192),  # Llama 3.2
        RopeScalingConfig(
            factor=4.0,
            low_freq_factor=2.0,
            high_freq_factor=8.0,
            original_max_position_embeddings=64,
        ),
        None,
    ],
    ids=["llama3.1", "llama3.2", "custom", "none"],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inv_frequencies_match_transformers(scaling, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig(
        dim=head_dim * 4,
        n_heads=4,
        n_kv_heads=2,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_seq_len=131072,
    )
    ours = inv_frequencies(cfg)
    hf = hf_config(cfg)
    if scaling is None:
        expected = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
        assert attention_factor == 1.0
        # The test is only meaningful if scaling moved the frequencies.
        assert not torch.allclose(
            expected,
            inv_frequencies(
                ModelConfig(
                    dim=head_dim * 4,
                    n_heads=4,
                    n_kv_heads=2,
                    rope_theta=500000.0,
                    rope_scaling=None,
                )
            ),
        )
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < 1e-6


def test_causal():
    cfg = small_cfg()
    model = seeded(cfg, 0).eval()
    x = tokens(cfg, shape=(2, 40))
    y = x.clone()
    y[:, 25] = (y[:, 25] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :25], b[:, :25])
    assert (a[:, 25:] - b[:, 25:]).abs().amax(dim=-1).min().item() > 0


def interleave_by_loop(q, k, v, n_heads, n_kv_heads):
    """The layout spelled out row block by row block: for each KV group g, its query heads
    g*q_per_kv .. (g+1)*q_per_kv - 1, then key head g, then value head g."""
    hd = k.shape[0] // n_kv_heads
    q_per_kv = n_heads // n_kv_heads
    rows = []
    for g in range(n_kv_heads):
        for j in range(q_per_kv):
            h = g * q_per_kv + j
            rows.append(q[h * hd : (h + 1) * hd])
        rows.append(k[g * hd : (g + 1) * hd])
        rows.append(v[g * hd : (g + 1) * hd])
    return torch.cat(rows)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 2), (6, 3), (4, 4), (8, 1)])
def test_interleave_and_split_qkv(n_heads, n_kv_heads):
    hd, dim = 3, 5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n_heads * hd, dim, generator=g)
    k, v = (torch.randn(n_kv_heads * hd, dim, generator=g) for _ in range(2))
    fused = interleave_qkv(q, k, v, n_kv_heads)
    assert torch.equal(fused, interleave_by_loop(q, k, v, n_heads, n_kv_heads))
    back = split_qkv(fused, n_heads, n_kv_heads)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    # TE's view of the projection output: (..., groups, q_per_kv + 2, head_dim).
    x = torch.randn(2, dim, generator=g)
    out = (x @ fused.T).view(2, n_kv_heads, n_heads // n_kv_heads + 2, hd)
    assert torch.allclose(out[:, :, -2].reshape(2, -1), x @ k.T, atol=1e-6)
    assert torch.allclose(out[:, :, -1].reshape(2, -1), x @ v.T, atol=1e-6)
    assert torch.allclose(out[:, :, :-2].reshape(2, -1), x @ q.T, atol=1e-6)


def separate_qkv_logits(cfg, weights, qkv_parts, tokens):
    """Llama written out with separate Q, K, V weights and explicit GQA (each K/V head
    repeated for its query heads), eager attention: the yardstick for the fused layout."""
    b, s = tokens.shape
    hd, rep = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    freqs = Llama(cfg).freqs[:s]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    x = F.embedding(tokens, weights["embed.weight"])
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        wq, wk, wv = qkv_parts[i]
        h = rms_norm(x, weights[p + "self_attention.layernorm_qkv.layer_norm_weight"], cfg.norm_eps)
        q = (h @ wq.T).view(b, s, cfg.n_heads, hd)
        k = (h @ wk.T).view(b, s, cfg.n_kv_heads, hd)
        v = (h @ wv.T).view(b, s, cfg.n_kv_heads, hd)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, -1)
        x = x + out @ weights[p + "self_attention.proj.weight"].T
        h = rms_norm(x, weights[p + "layernorm_mlp.layer_norm_weight"], cfg.norm_eps)
        gate, up = (h @ weights[p + "layernorm_mlp.fc1_weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ weights[p + "layernorm_mlp.fc2_weight"].T
    x = rms_norm(x, weights["norm.weight"], cfg.norm_eps)
    return x @ weights.get("lm_head.weight", weights["embed.weight"]).T


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_fused_qkv_matches_separate_projections(n_kv_heads):
    cfg = small_cfg(n_kv_heads=n_kv_heads)
    model = seeded(cfg, 5)
    sd = model.state_dict()
    g = torch.Generator().manual_seed(11)
    parts = []
    for i in range(cfg.n_layers):
        q = torch.randn(cfg.n_heads * cfg.head_dim, cfg.dim, generator=g) * 0.1
        k, v = (
            torch.randn(n_kv_heads * cfg.head_dim, cfg.dim, generator=g) * 0.1 for _ in range(2)
        )
        parts.append((q, k, v))
        sd[f"layers.{i}.{QKV}"] = interleave_by_loop(q, k, v, cfg.n_heads, n_kv_heads)
    model.load_state_dict(sd)
    x = tokens(cfg)
    with torch.no_grad():
        got = model(x)
        want = separate_qkv_logits(cfg, sd, parts, x)
    assert want.std().item() > 0.1
    assert (got - want).abs().max().item() < 1e-5
    # A layout mix-up (here: K and V swapped in every group) must show up in the logits.
    for i, (q, k, v) in enumerate(parts):
        sd[f"layers.{i}.{QKV}"] = interleave_by_loop(q, v, k, cfg.n_heads, n_kv_heads)
    model.load_state_dict(sd)
    with torch.no_grad():
        assert (model(x) - want).abs().max().item() > 1e-3


def test_gqa_matches_repeated_kv_heads():
    # GQA with n_kv_heads=2 equals MHA whose K/V heads are the GQA heads repeated in place
    # (query head h reads kv head h // (n_heads / n_kv_heads)).
    cfg = small_cfg()
    mha_cfg = small_cfg(n_kv_heads=cfg.n_heads)
    gqa, mha = seeded(cfg, 1), Llama(mha_cfg)
    sd = gqa.state_dict()
    rep = cfg.n_heads // cfg.n_kv_heads
    for i in range(cfg.n_layers):
        key = f"layers.{i}.{QKV}"
        q, k, v = split_qkv(sd[key], cfg.n_heads, cfg.n_kv_heads)
        k, v = (
            t.view(cfg.n_kv_heads, cfg.head_dim, cfg.dim).repeat_interleave(rep, 0) for t in (k, v)
        )
        sd[key] = interleave_by_loop(
            q, k.reshape(-1, cfg.dim), v.reshape(-1, cfg.dim), cfg.n_heads, cfg.n_heads
        )
    mha.load_state_dict(sd)
    x = tokens(cfg)
    with torch.no_grad():
        assert (gqa(x) - mha(x)).abs().max().item() < 1e-5


def test_forward_shape_and_dtype_under_autocast():
    cfg = small_cfg()
    model = seeded(cfg, 0)
    x = tokens(cfg, shape=(3, 17))
    out = model(x)
    assert out.shape == (3, 17, cfg.padded_vocab_size) and out.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
    assert low.dtype == torch.bfloat16
    assert (low.float() - out).abs().max().item() < 0.05


#: Peak GiB measured on H200s at seq 8192 (docs/PERFORMANCE.md step tables): llama3_1b, micro batch 4, one
#: GPU, bf16 (within 15%).
MEASURED_PEAK_GIB = {
    ("llama3_1b", 1, 4, "none"): 56.1,
    ("llama3_1b", 1, 4, "selective"): 29.1,
    ("llama3_1b", 1, 4, "full"): 22.1,
}
#: llama3_8b, micro batch 1, FSDP over two H200s, global batch 8 (4 micro batches a rank),
#: train.py through tools/bench_step.py (docs/PERFORMANCE.md, 2026-11-26): (recipe, quantized
#: weights, recomputation) -> peak GiB. The estimate must be within 10% of each.
MEASURED_8B_ACCUMULATING_GIB = {
    ("bf16", False, "none"): 99.15,
    ("fp8_cs", True, "none"): 100.45,
    ("fp8_cs", True, "selective"): 81.03,
    ("fp8_cs", True, "full"): 72.5,
    ("bf16", False, "full"): 67.1,
}


def _estimate_8b_on_two_gpus(**kwargs) -> float:
    """The start-up estimate at llama3_8b, seq 8192, micro batch 1, FSDP over 2, accumulating."""
    from config import compose_config
    from model.memory import estimate_gpu_memory

    mcfg = compose_config(["model=llama3_8b"]).model
    est = estimate_gpu_memory(
        mcfg, seq_len=8192, micro_batch=1, shards=2, accumulating=True, **kwargs
    )
    return est["total"]


@pytest.mark.parametrize("case", list(MEASURED_8B_ACCUMULATING_GIB))
def test_memory_estimate_is_within_10_percent_at_8b(case):
    _, quantized, ac = case
    total = _estimate_8b_on_two_gpus(activation_checkpointing=ac, quantized_weights=quantized)
    assert abs(total / MEASURED_8B_ACCUMULATING_GIB[case] - 1) < 0.10, total


#: llama3_8b, micro batch 1, FSDP over two H200s, global batch 128 (64 micro batches a rank;
#: the keep_gathered_blocks row at global batch 8), the FSDP and optimizer levers
#: (docs/PERFORMANCE.md, global batch 128 tables): (recipe, quantized weights,
#: parallel.grad_reduce, parallel.reduce_dtype, blocks kept gathered (32: reshard_after_forward=
#: false), recomputation, optim.moment_dtype) -> peak GiB of train.py through
#: tools/bench_step.py. The bf16-moment rows are the latest measurements, with the kept blocks
#: held gathered through the micro batches (0.2-0.4 GiB below the calls before).
MEASURED_8B_LEVERS_GIB = {
    ("fp8_cs", True, "step", "fp32", 1, "none", "fp32"): 115.4,
    ("bf16", False, "step", "fp32", 1, "none", "fp32"): 114.1,
    ("fp8_cs", True, "step", "bf16", 1, "none", "fp32"): 100.5,
    ("fp8_cs", True, "step", "bf16", 32, "none", "fp32"): 107.7,
    ("bf16", False, "step", "bf16", 1, "none", "fp32"): 99.2,
    ("bf16", False, "step", "bf16", 32, "none", "fp32"): 112.7,
    ("fp8_cs", False, "step", "bf16", 1, "none", "fp32"): 95.7,
    ("bf16", False, "step", "bf16", 14, "none", "fp32"): 104.4,
    ("fp8_cs", True, "step", "bf16", 32, "none", "bf16"): 92.6,
    ("fp8_cs", True, "step", "bf16", 32, "selective", "bf16"): 73.1,
    ("bf16", False, "step", "bf16", 32, "none", "bf16"): 97.4,
}


@pytest.mark.parametrize("case", list(MEASURED_8B_LEVERS_GIB))
def test_memory_estimate_follows_the_fsdp_levers_at_8b(case):
    _, quantized, grad_reduce, reduce_dtype, kept, ac, moments = case
    total = _estimate_8b_on_two_gpus(
        quantized_weights=quantized,
        grad_reduce_step=grad_reduce == "step",
        reduce_bytes=4 if reduce_dtype == "fp32" else 2,
        kept_blocks=kept,
        activation_checkpointing=ac,
        moment_bytes=4 if moments == "fp32" else 2,
    )
    assert abs(total / MEASURED_8B_LEVERS_GIB[case] - 1) < 0.05, total


@pytest.mark.parametrize("case", list(MEASURED_PEAK_GIB))
def test_memory_estimate_is_within_15_percent_of_measured_peaks(case):
    from config import compose_config
    from model.memory import estimate_gpu_memory

    name, gpus, mbs, ac = case
    mcfg = compose_config([f"model={name}"]).model
    est = estimate_gpu_memory(
        mcfg, seq_len=8192, micro_batch=mbs, shards=gpus, activation_checkpointing=ac
    )
    assert abs(est["total"] / MEASURED_PEAK_GIB[case] - 1) < 0.15, est
    # Context parallelism divides the activations, not the states; sharding divides states.
    cp2 = estimate_gpu_memory(
        mcfg, seq_len=8192, micro_batch=mbs, shards=2 * gpus, cp=2, activation_checkpointing=ac
    )
    assert cp2["activations"] == pytest.approx(est["activations"] / 2)
    assert cp2["states"] == pytest.approx(est["states"] / 2)
