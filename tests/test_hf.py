"""Reference Llama vs Hugging Face LlamaForCausalLM with the same weights (model/hf.py); the
file side (init_from, export, tokenizer) in process (checkpoint/hf.py); tests/test_hf_io.py
runs them through train.py on 2 processes.

Tiny config with GQA, Llama-3 RoPE scaling that changes frequencies at the tested length,
and a vocabulary that needs padding; both tied and untied embeddings.
"""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from config import ConfigError
from model.config import ModelConfig, RopeScalingConfig
from model.hf import (
    fill_from_hf,
    from_hf_state_dict,
    hf_config,
    model_config_for_hf,
    model_config_from_hf,
    to_hf_state_dict,
    weight_layout,
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


def hf_model(cfg: ModelConfig, random_norms: bool = False) -> LlamaForCausalLM:
    """random_norms: norm weights drawn around one (HF makes them ones), so that a swapped
    norm shows in the logits."""
    conf = hf_config(cfg)
    conf._attn_implementation = "eager"
    model = LlamaForCausalLM(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if random_norms and "norm" in name:
                p.normal_(1.0, 0.1)
    return model


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
    hf = hf_model(cfg, random_norms=True)
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


def test_fill_from_hf_reads_only_the_entries_asked_for():
    """A rank's part of a parameter: any global rows (here two runs, as fc1's [gate_r; up_r]
    under TP, reaching into the vocabulary padding for the embedding) and columns."""
    cfg = tiny_cfg(False)
    torch.manual_seed(5)
    hf_sd = hf_model(cfg).state_dict()
    full = from_hf_state_dict(hf_sd, cfg)
    layout = weight_layout(cfg)
    read_rows = []

    def get(name, rows, cols):
        read_rows.append(rows.stop - rows.start)
        t = hf_sd[name][rows]
        return t if cols is None else t[:, cols]

    for name in (
        "embed.weight",
        "layers.1.self_attention.layernorm_qkv.weight",
        "layers.0.layernorm_mlp.fc1_weight",
        "layers.0.layernorm_mlp.fc2_weight",
        "norm.weight",
    ):
        t = full[name]
        n = t.shape[0]
        rows = torch.cat([torch.arange(5, n // 2 - 7), torch.arange(n // 2 + 3, n - 2)])
        index = [rows] + ([torch.arange(10, 40)] if t.ndim == 2 else [])
        out = torch.full((len(rows), *([30] if t.ndim == 2 else [])), float("nan"))
        read_rows.clear()
        fill_from_hf(out, layout[name], index, get)
        want = t[rows] if t.ndim == 1 else t[rows][:, 10:40]
        assert torch.equal(out, want), name
        assert sum(read_rows) <= len(rows), name  # nothing outside the part is read


def test_model_config_taken_from_or_checked_against_config_json():
    cfg = tiny_cfg(True)
    d = hf_config(cfg).to_dict()
    hf = ModelConfig(name="hf", init_from="x", shape_from_hf=True, pad_vocab_multiple=64)
    filled = model_config_for_hf(hf, d)
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "norm_eps"):
        assert getattr(filled, f) == getattr(cfg, f), f
    assert filled.rope_scaling == cfg.rope_scaling and filled.tie_embeddings
    assert filled.max_seq_len == cfg.max_seq_len
    assert (filled.name, filled.pad_vocab_multiple, filled.init_from) == ("hf", 64, "x")

    same = ModelConfig(**{**cfg.__dict__, "init_from": "x"})
    assert model_config_for_hf(same, d) is same
    other = ModelConfig(**{**cfg.__dict__, "init_from": "x", "dim": 128, "n_layers": 4})
    with pytest.raises(ConfigError) as e:
        model_config_for_hf(other, d)
    msg = str(e.value)
    assert "\n" not in msg
    assert "model.dim=128 (config.json: 64)" in msg and "model.n_layers=4 (config.json: 2)" in msg
    assert "model=hf" in msg


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_load_hf_weights_from_save_pretrained(tmp_path, tied):
    """transformers' own sharded safetensors folder -> our model, one process."""
    from checkpoint.hf import load_hf_weights

    cfg = tiny_cfg(tied)
    torch.manual_seed(6)
    hf = hf_model(cfg, random_norms=True)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = Llama(cfg)
    load_hf_weights(ours, cfg, tmp_path)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = ours.eval()(tokens)
        diff = (got[..., : cfg.vocab_size] - hf(tokens).logits).abs().max().item()
    print(f"load_hf_weights ({'tied' if tied else 'untied'}): max abs logits diff {diff:.3e}")
    assert diff < 1e-5
    assert torch.equal(got[..., cfg.vocab_size :], torch.zeros_like(got[..., cfg.vocab_size :]))


def test_load_hf_weights_names_a_wrong_folder(tmp_path):
    from checkpoint.hf import load_hf_weights

    hf_model(tiny_cfg(True)).save_pretrained(tmp_path)  # tied: the file has no lm_head
    cfg = tiny_cfg(False)
    with pytest.raises(ConfigError, match=r"missing: \['lm_head.weight'\]"):
        load_hf_weights(Llama(cfg), cfg, tmp_path)
    wider = ModelConfig(**{**tiny_cfg(True).__dict__, "ffn_dim": 128})
    with pytest.raises(
        ConfigError,
        match=r"down_proj.weight has shape \(64, 96\), the model config expects \(64, 128\)",
    ):
        load_hf_weights(Llama(wider), wider, tmp_path)
    hf_model(tiny_cfg(True)).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    (tmp_path / "sharded" / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"lacks model-00002-of-00004.safetensors \(listed in"):
        load_hf_weights(Llama(tiny_cfg(True)), tiny_cfg(True), tmp_path / "sharded")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match=r"no \*.safetensors"):
        load_hf_weights(Llama(tiny_cfg(True)), tiny_cfg(True), tmp_path)


def test_init_from_resolution(tmp_path, monkeypatch):
    import huggingface_hub

    from checkpoint import hf as hfio

    assert hfio.resolve_init_from(str(tmp_path), weights=True) == tmp_path  # local: as is
    calls = []

    def fake(repo_id, allow_patterns, local_files_only):
        calls.append((repo_id, allow_patterns, local_files_only))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hfio.resolve_init_from("org/llama", weights=True) == tmp_path
    assert hfio.resolve_init_from("org/llama", weights=False) == tmp_path
    assert calls == [
        ("org/llama", ["*.json", "*.safetensors", "tokenizer*"], False),
        ("org/llama", ["config.json"], False),
    ]

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match=r"model.init_from=org/llama .*OSError: We couldn't"):
        hfio.resolve_init_from("org/llama", weights=True)
    with pytest.raises(ConfigError, match="no such folder"):
        hfio.resolve_init_from(str(tmp_path / "missing"), weights=True)


def test_byte_tokenizer_json_gives_byte_tokenizer_ids(tmp_path):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from checkpoint.hf import _byte_symbols, byte_tokenizer
    from data.tokenizer import ByteTokenizer

    assert len(set(_byte_symbols())) == 256
    assert set(_byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())
    byte_tokenizer(64).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tok, PreTrainedTokenizerFast)
    ref = ByteTokenizer()
    assert (len(tok), tok.bos_token_id, tok.eos_token_id) == (258, ref.bos_id, ref.eos_id)
    assert tok.convert_tokens_to_ids(_byte_symbols()) == list(range(256))
    texts = [
        "def f(x):\n\treturn x  # plain ASCII, spaces  and tabs",
        "naïve café, Größe, Ωμέγα, 日本語, emoji 🙂👍🏽",
        "\x00\x01\x7f control bytes and text that looks special: <|bos|> <|eos|>",
        " leading space",
        "",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == text
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=True) == "hi"


def test_unsupported_init_from_names_the_field():
    d = hf_config(tiny_cfg(False)).to_dict()
    d["hidden_act"] = "gelu"
    with pytest.raises(ConfigError, match=r"^model.init_from=x: HF config: hidden_act='gelu'"):
        model_config_for_hf(ModelConfig(init_from="x", shape_from_hf=True), d)


@pytest.mark.parametrize("preset", ["tiny", "small", "llama3_1b"])
def test_exported_config_is_consistent_for_transformers(preset):
    """The presets' config.json loads without transformers' rope warning (tiny and small keep
    Llama 3's scaling on a context shorter than its original_max_position_embeddings), and
    transformers computes the same RoPE frequencies from it as ours."""
    import logging

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from config import compose_config

    cfg = compose_config([f"model={preset}"]).model
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        exported = hf_config(cfg).to_dict()  # what export writes (config.json) ...
        loaded = LlamaConfig.from_dict(exported)  # ... and what loading it reads
    finally:
        root.removeHandler(handler)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    params = loaded.rope_parameters
    assert params["original_max_position_embeddings"] < loaded.max_position_embeddings
    inv, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](loaded, "cpu")
    assert torch.allclose(inv.float(), inv_frequencies(cfg).float(), rtol=1e-6, atol=0)
    # Read back: every field the same but max_seq_len, which becomes the stretched context
    # where it had to (a longer limit: every sequence the model took, it still takes).
    back = model_config_from_hf(exported, name=cfg.name)
    assert back == replace(cfg, max_seq_len=back.max_seq_len, init_from=None)
    assert back.max_seq_len >= cfg.max_seq_len
