"""Reference Llama vs Hugging Face LlamaForCausalLM with the same weights (model/hf.py).

Tiny config with GQA, Llama-3 RoPE scaling that changes frequencies at the tested length,
and a vocabulary that needs padding; both tied and untied embeddings.
"""

import pytest
import torch
from transformers import LlamaForCausalLM

from config import ConfigError
from model.config import ModelConfig, RopeScalingConfig
from model.hf import (
    from_hf_state_dict,
    hf_config,
    load_hf,
    model_config_from_hf,
    save_hf,
    to_hf_state_dict,
)
from model.init import init_weights
from model.llama import Llama
from model.rope import inv_frequencies

SEQ = 48


def tiny_cfg(tied: bool) -> ModelConfig:
    return ModelConfig(
        name="hf-test",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        vocab_size=300,  # padded to 384
        pad_vocab_multiple=128,
        max_seq_len=64,
        rope_theta=10000.0,
        # head_dim 16: wavelengths 6.3 .. 3e4 positions; the band limits are 16/4 and 16/1,
        # so the highest frequency is blended and the seven others are divided by `factor`.
        rope_scaling=RopeScalingConfig(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        tie_embeddings=tied,
    )


def hf_model(cfg: ModelConfig) -> LlamaForCausalLM:
    conf = hf_config(cfg)
    conf._attn_implementation = "eager"
    return LlamaForCausalLM(conf).float().eval()


def ours_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    model = Llama(cfg)
    init_weights(model, cfg, seed)
    # Norm weights init to ones; random ones make a swapped norm show up in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm_weight", "norm.weight")):
                p.add_(
                    torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1
                )
    return model.eval()


def load_into_hf(model: LlamaForCausalLM, hf_sd: dict, tied: bool) -> None:
    result = model.load_state_dict(hf_sd, strict=False)
    assert result.unexpected_keys == []
    # A tied HF model has lm_head.weight only as an alias of the embedding.
    assert result.missing_keys == (["lm_head.weight"] if tied else [])
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_scaling_changes_frequencies():
    cfg = tiny_cfg(False)
    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
    scaled, base = inv_frequencies(cfg), inv_frequencies(plain)
    assert torch.allclose(scaled[1:], base[1:] / 8)
    assert base[0] / 8 < scaled[0] < base[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ours_to_hf_logits_match(tied):
    cfg = tiny_cfg(tied)
    ours = ours_model(cfg)
    hf = hf_model(cfg)
    load_into_hf(hf, to_hf_state_dict(ours.state_dict(), cfg), tied)

    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ours(tokens)[..., : cfg.vocab_size]
        got = hf(tokens).logits
    diff = (ref - got).abs().max().item()
    print(
        f"ours->HF ({'tied' if tied else 'untied'}): max abs logits diff {diff:.3e}, "
        f"logit std {ref.std().item():.3f}"
    )
    assert diff < 1e-4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_ours_logits_match(tied):
    cfg = tiny_cfg(tied)
    torch.manual_seed(2)
    hf = hf_model(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    hf_sd = hf.state_dict()
    ours = Llama(cfg).eval()
    result = ours.load_state_dict(from_hf_state_dict(hf_sd, cfg), strict=True)
    assert not result.missing_keys and not result.unexpected_keys

    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits
        got_full = ours(tokens)
    diff = (ref - got_full[..., : cfg.vocab_size]).abs().max().item()
    print(f"HF->ours ({'tied' if tied else 'untied'}): max abs logits diff {diff:.3e}")
    assert diff < 1e-4
    # Padding rows of the imported embedding/head are zeros, so padded logits are exactly 0.
    assert torch.equal(
        got_full[..., cfg.vocab_size :], torch.zeros_like(got_full[..., cfg.vocab_size :])
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trips_are_exact(tied):
    cfg = tiny_cfg(tied)
    sd = ours_model(cfg).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, cfg), cfg)
    assert set(back) == set(sd)
    v = cfg.vocab_size
    for k, t in sd.items():
        if k in ("embed.weight", "lm_head.weight"):
            # HF has no padding rows: they come back as zeros, the real rows bit-exact.
            assert torch.equal(back[k][:v], t[:v]), k
            assert torch.equal(back[k][v:], torch.zeros_like(t[v:])), k
        else:
            assert torch.equal(back[k], t), k

    torch.manual_seed(4)
    hf_sd = hf_model(cfg).state_dict()
    if tied:
        hf_sd.pop("lm_head.weight")
    again = to_hf_state_dict(from_hf_state_dict(hf_sd, cfg), cfg)
    assert set(again) == set(hf_sd)
    for k, t in hf_sd.items():
        assert torch.equal(again[k], t), k


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_config_round_trip(tied):
    cfg = tiny_cfg(tied)
    assert model_config_from_hf(hf_config(cfg), name=cfg.name) == cfg
    assert model_config_from_hf(hf_config(cfg).to_dict(), name=cfg.name) == cfg
    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
    assert model_config_from_hf(hf_config(plain), name=cfg.name) == plain


def test_transformers_4_config_format():
    # config.json as written by transformers 4.x (rope_theta + rope_scaling with "type").
    d = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
    }
    assert model_config_from_hf(d, name="hf-test") == tiny_cfg(False)


def test_unsupported_hf_config_is_one_clear_line():
    d = hf_config(tiny_cfg(False)).to_dict()
    d["attention_bias"] = True
    with pytest.raises(ConfigError, match="attention_bias"):
        model_config_from_hf(d)
    d = hf_config(tiny_cfg(False)).to_dict()
    d["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        model_config_from_hf(d)


def test_mismatched_state_dict_names_the_problem():
    cfg = tiny_cfg(False)
    sd = ours_model(cfg).state_dict()
    del sd["lm_head.weight"]
    with pytest.raises(ConfigError, match="lm_head.weight"):
        to_hf_state_dict(sd, cfg)
    hf_sd = to_hf_state_dict(ours_model(cfg).state_dict(), cfg)
    bad = ModelConfig(**{**cfg.__dict__, "ffn_dim": 128})
    with pytest.raises(ConfigError, match="shape"):
        from_hf_state_dict(hf_sd, bad)


def test_qkv_rows_follow_hf_heads():
    """Our fused QKV, per KV group g: HF's query heads of g (h // q_per_kv == g), then
    k_proj head g, then v_proj head g."""
    cfg = tiny_cfg(False)
    hf_sd = to_hf_state_dict(ours_model(cfg).state_dict(), cfg)
    hd, q_per_kv = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    qkv = from_hf_state_dict(hf_sd, cfg)["layers.1.self_attention.layernorm_qkv.weight"]
    groups = qkv.view(cfg.n_kv_heads, (q_per_kv + 2) * hd, cfg.dim)
    hp = "model.layers.1.self_attn."
    for g in range(cfg.n_kv_heads):
        heads = hf_sd[hp + "q_proj.weight"].view(cfg.n_heads, hd, cfg.dim)
        want = torch.cat(
            [
                *heads[g * q_per_kv : (g + 1) * q_per_kv],
                hf_sd[hp + "k_proj.weight"].view(-1, hd, cfg.dim)[g],
                hf_sd[hp + "v_proj.weight"].view(-1, hd, cfg.dim)[g],
            ]
        )
        assert torch.equal(groups[g], want), g


def test_kv_head_mismatch_names_the_projection():
    cfg = tiny_cfg(False)
    hf_sd = to_hf_state_dict(ours_model(cfg).state_dict(), cfg)
    mqa = ModelConfig(**{**cfg.__dict__, "n_kv_heads": 1})
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.k_proj.weight has shape"):
        from_hf_state_dict(hf_sd, mqa)


@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 40_000], ids=["one-file", "sharded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_load_files(tmp_path, tied, shard_bytes):
    cfg = tiny_cfg(tied)
    ours = ours_model(cfg)
    save_hf(ours.state_dict(), cfg, tmp_path, max_shard_bytes=shard_bytes)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (len(shards) > 1) == (shard_bytes < 2**20), shards
    assert (tmp_path / "model.safetensors.index.json").exists() == (len(shards) > 1)

    loaded_cfg, sd = load_hf(tmp_path, name=cfg.name)
    assert loaded_cfg == cfg
    expected = from_hf_state_dict(to_hf_state_dict(ours.state_dict(), cfg), cfg)
    assert set(sd) == set(expected)
    for k in sd:
        assert torch.equal(sd[k], expected[k]), k

    # transformers itself reads the directory and gives the same logits.
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)[..., : cfg.vocab_size]).abs().max().item()
    assert diff < 1e-4, diff


def test_save_hf_casts_dtype(tmp_path):
    cfg = tiny_cfg(False)
    save_hf(ours_model(cfg).state_dict(), cfg, tmp_path, dtype=torch.bfloat16)
    _, sd = load_hf(tmp_path)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}


def test_convert_cli_round_trip(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "convert_hf.py"
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    cfg = tiny_cfg(False)
    yaml = tmp_path / "model.yaml"
    yaml.write_text(tool.model_yaml(cfg))
    assert tool.load_model_config(str(yaml)) == cfg
    src = tmp_path / "ours.pt"
    torch.save(ours_model(cfg).state_dict(), src)

    rc = tool.main(
        ["export", str(src), str(tmp_path / "hf"), "--model", str(yaml), "--dtype", "bf16"]
    )
    assert rc == 0
    rc = tool.main(
        [
            "import",
            str(tmp_path / "hf"),
            str(tmp_path / "back.pt"),
            "--name",
            cfg.name,
            "--model-yaml",
            str(tmp_path / "back.yaml"),
        ]
    )
    assert rc == 0
    assert tool.load_model_config(str(tmp_path / "back.yaml")) == cfg
    sd, back = torch.load(src), torch.load(tmp_path / "back.pt")
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k][: cfg.vocab_size], sd[k][: cfg.vocab_size].bfloat16()), k

    assert tool.main(["export", str(src), str(tmp_path / "x"), "--model", "no_such_model"]) == 2
    assert "no such conf/model name" in capsys.readouterr().err
