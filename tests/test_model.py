"""Reference model (model/llama.py): seeded init, meta-device construction, RoPE, causality."""

import pytest
import torch

from model.config import ModelConfig, RopeScalingConfig
from model.hf import hf_config
from model.init import init_weights
from model.llama import Llama
from model.rope import inv_frequencies


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
    assert not torch.equal(
        a["layers.0.self_attention.layernorm_qkv.key_weight"],
        a["layers.0.self_attention.layernorm_qkv.value_weight"],
    )


def test_init_std_follows_config():
    cfg = small_cfg(dim=256, n_heads=4, ffn_dim=512, n_layers=8)
    sd = seeded(cfg, 0).state_dict()
    assert sd["embed.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.05)
    out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    assert sd["layers.3.layernorm_mlp.fc2_weight"].std().item() == pytest.approx(out_std, rel=0.05)
    assert sd["layers.3.self_attention.proj.weight"].std().item() == pytest.approx(
        out_std, rel=0.05
    )


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
    assert shapes["layers.1.self_attention.layernorm_qkv.query_weight"] == (
        cfg.n_heads * hd,
        cfg.dim,
    )
    assert shapes["layers.1.self_attention.layernorm_qkv.key_weight"] == (
        cfg.n_kv_heads * hd,
        cfg.dim,
    )
    assert shapes["layers.1.layernorm_mlp.fc1_weight"] == (2 * cfg.ffn_dim, cfg.dim)
    assert len(shapes) == 3 + 8 * cfg.n_layers
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


def test_gqa_matches_repeated_kv_heads():
    # GQA with n_kv_heads=2 equals MHA whose K/V heads are the GQA heads repeated in place
    # (query head h reads kv head h // (n_heads / n_kv_heads)).
    cfg = small_cfg()
    mha_cfg = small_cfg(n_kv_heads=cfg.n_heads)
    gqa, mha = seeded(cfg, 1), Llama(mha_cfg)
    sd = gqa.state_dict()
    rep = cfg.n_heads // cfg.n_kv_heads
    for i in range(cfg.n_layers):
        for w in ("key_weight", "value_weight"):
            k = f"layers.{i}.self_attention.layernorm_qkv.{w}"
            sd[k] = sd[k].view(cfg.n_kv_heads, cfg.head_dim, cfg.dim).repeat_interleave(rep, 0)
            sd[k] = sd[k].reshape(-1, cfg.dim)
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
