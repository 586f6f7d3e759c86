"""Convert between Hugging Face Llama checkpoints and this repo's state-dict layout.

    # HF directory (config.json + *.safetensors) -> our state dict (torch.save) + model YAML
    python tools/convert_hf.py import ~/models/Llama-3.2-1B weights/llama3_1b.pt \
        --model-yaml conf/model/llama3_1b_hf.yaml
    # our state dict -> HF directory loadable by transformers.LlamaForCausalLM.from_pretrained
    python tools/convert_hf.py export weights/llama3_1b.pt out/llama3_1b_hf --model llama3_1b \
        --dtype bf16
    # tiny CPU round trip: export a random tiny model, import it back
    python tools/convert_hf.py export tiny.pt /tmp/tiny_hf --model tiny --random-init 0
    python tools/convert_hf.py import /tmp/tiny_hf /tmp/tiny.pt

`import` prints the model config as YAML (or writes it with --model-yaml, ready for conf/model/)
because our checkpoints do not carry it. `export` takes the model config from --model: a
conf/model name or a YAML path, plus optional key=value overrides (`--set vocab_size=128256`).
The state-dict file holds `model.state_dict()` of either implementation (TE `_extra_state`
entries are ignored); a {"model": state_dict} wrapper is accepted. Exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from errors import ConfigError  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.hf import load_hf, save_hf  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model_config(spec: str, overrides: list[str] | None = None) -> ModelConfig:
    """A conf/model name ("tiny") or a YAML path, merged onto the ModelConfig schema."""
    path = Path(spec)
    if not path.suffix:
        path = ROOT / "conf" / "model" / f"{spec}.yaml"
    if not path.is_file():
        raise ConfigError(f"--model {spec!r}: no such conf/model name or YAML file")
    values = OmegaConf.load(path)
    values.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), values)
    if overrides:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_object(merged)


def model_yaml(cfg: ModelConfig) -> str:
    body = OmegaConf.to_yaml(OmegaConf.create(asdict(cfg)))
    header = "# Converted from Hugging Face by tools/convert_hf.py.\n"
    return f"{header}\n{body}"


def cmd_import(args) -> None:
    cfg, sd = load_hf(args.hf_dir, name=args.name)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, out)
    n = sum(t.numel() for t in sd.values())
    print(f"wrote {out}: {len(sd)} tensors, {n / 1e6:.1f}M parameters", file=sys.stderr)
    if args.model_yaml:
        Path(args.model_yaml).write_text(model_yaml(cfg))
        print(f"wrote {args.model_yaml}", file=sys.stderr)
    else:
        print(model_yaml(cfg))


def cmd_export(args) -> None:
    cfg = load_model_config(args.model, args.set)
    src = Path(args.state_dict)
    if args.random_init is not None:
        # A freshly initialized reference model, for trying the tool without a checkpoint.
        from model.init import init_weights
        from model.llama import Llama

        model = Llama(cfg)
        init_weights(model, cfg, args.random_init)
        torch.save(model.state_dict(), src)
    if not src.is_file():
        raise ConfigError(f"{src}: no such state-dict file")
    sd = torch.load(src, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict):
        sd = sd["model"]
    save_hf(sd, cfg, args.hf_dir, dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"wrote {args.hf_dir} (model {cfg.name})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> our state dict file")
    imp.add_argument("hf_dir")
    imp.add_argument("out", help="output .pt file (torch.save of the state dict)")
    imp.add_argument("--name", help="model.name in the printed config (default: directory name)")
    imp.add_argument("--model-yaml", help="write the model config here instead of printing it")
    imp.set_defaults(func=cmd_import)
    exp = sub.add_parser("export", help="our state dict file -> HF directory")
    exp.add_argument("state_dict", help=".pt file holding model.state_dict()")
    exp.add_argument("hf_dir")
    exp.add_argument("--model", required=True, help="conf/model name or model YAML path")
    exp.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides"
    )
    exp.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep)")
    exp.add_argument(
        "--random-init",
        type=int,
        metavar="SEED",
        help="first write a seeded random model to state_dict",
    )
    exp.set_defaults(func=cmd_export)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
