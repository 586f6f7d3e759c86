"""Sample text from a trained model: a run's newest checkpoint or a Hugging Face export.

    python tools/sample.py runs/tiny-bf16-fsdp --prompt "def main("
    python tools/sample.py runs/tiny-bf16-fsdp --prompt "import " --temperature 0  # greedy
    python tools/sample.py out/hf --prompt "class " --max-new-tokens 200     # an export folder

SOURCE is a run directory (its newest committed checkpoint), a checkpoint step folder, or a
folder written by `tools/convert_hf.py export` (config.json + safetensors + tokenizer). The
model is the plain-PyTorch reference implementation, on the CPU (or --device cuda), in fp32:
a checkpoint of any layout or precision recipe loads into it (quantized-weight checkpoints give
their fp32 master weights). The prompt is encoded by the run's tokenizer (data.tokenizer) or
the export's, after the tokenizer's BOS, as training documents start; generation stops at EOS
or after --max-new-tokens. Softmax sampling at --temperature (default 0.8) over the --top-k
most likely tokens (default 20; 0: all), from a generator seeded with --seed, so a command
gives the same text every time; --temperature 0 is greedy decoding (on the default run's tiny
model, a run of spaces). Prints the prompt and its continuation.
Exit status 2 on bad input (one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from errors import ConfigError  # noqa: E402


class Sampler:
    """A loaded model and its tokenizer: `generate(prompt, ...)` returns the new token ids,
    `decode(ids)` their text."""

    def __init__(self, model, cfg, encode, decode, bos_id, eos_id, source: str):
        self.model, self.cfg = model, cfg
        self.encode, self.decode = encode, decode
        self.bos_id, self.eos_id, self.source = bos_id, eos_id, source

    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 100,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> list[int]:
        device = next(self.model.parameters()).device
        ids = ([] if self.bos_id is None else [self.bos_id]) + list(self.encode(prompt))
        generator = torch.Generator().manual_seed(seed)
        new: list[int] = []
        for _ in range(max_new_tokens):
            context = torch.tensor([ids[-self.cfg.max_seq_len :]], device=device)
            logits = self.model(context)[0, -1, : self.cfg.vocab_size].float().cpu()
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token == self.eos_id:
                break
            ids.append(token)
            new.append(token)
        return new


def _reference(cfg, device: str):
    from model.llama import Llama

    with torch.device(device):
        model = Llama(cfg)
    return model.eval()


def load_export(folder: Path, device: str = "cpu") -> Sampler:
    """An HF folder of `tools/convert_hf.py export` (or any Llama checkpoint folder)."""
    from transformers import AutoTokenizer

    from checkpoint.hf import load_hf_weights, read_hf_config
    from model.hf import model_config_from_hf

    cfg = model_config_from_hf(read_hf_config(folder), name=folder.name)
    model = _reference(cfg, device)
    load_hf_weights(model, cfg, folder)
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise ConfigError(
            f"{folder}: no usable tokenizer files there ({e}); export again"
        ) from None
    return Sampler(
        model,
        cfg,
        lambda text: tok(text, add_special_tokens=False)["input_ids"],
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        tok.bos_token_id,
        tok.eos_token_id,
        f"export {folder}",
    )


def load_checkpoint(path: Path, device: str = "cpu") -> Sampler:
    """A run directory, a folder of checkpoints or a step folder: the newest committed one."""
    from checkpoint.hf import checkpoint_model_weights
    from data.config import DataConfig
    from data.tokenizer import build_tokenizer

    cfg, saved, step_dir, weights = checkpoint_model_weights(path)
    model = _reference(cfg, device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k in dict(model.named_parameters())]:
        raise ConfigError(f"checkpoint {step_dir} does not fit its own model config")
    tok = build_tokenizer(DataConfig(tokenizer=(saved.get("data") or {}).get("tokenizer", "byte")))
    return Sampler(
        model, cfg, tok.encode, tok.decode, tok.bos_id, tok.eos_id, f"checkpoint {step_dir}"
    )


def load(source: str | Path, device: str = "cpu") -> Sampler:
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{source} does not exist; pass a run directory (runs/<name>), a checkpoint step "
            "folder or an export folder"
        )
    if (path / "config.json").is_file():
        return load_export(path, device)
    return load_checkpoint(path, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", help="run directory, checkpoint step folder or export folder")
    parser.add_argument("--prompt", default="", help="text to continue (default: none)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    # Sampling by default: greedy decoding of a small model (the default run's) loops on the
    # likeliest byte (a run of spaces); 0.8 among the 20 likeliest gives text of its kind.
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0.8 (default); 0: greedy decoding"
    )
    parser.add_argument(
        "--top-k", type=int, default=20, help="sample among the k most likely (default 20; 0: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        if args.temperature < 0 or args.top_k < 0:
            raise ConfigError("--temperature and --top-k must be >= 0 (0: greedy / all tokens)")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {args.device}: no CUDA GPU is visible; use --device cpu")
        sampler = load(args.source, args.device)
        new = sampler.generate(
            args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = "greedy" if args.temperature <= 0 else f"temperature {args.temperature}"
    mode += f", top-k {args.top_k}" if args.temperature > 0 and args.top_k else ""
    print(
        f"sample: {sampler.source}, {len(new)} new tokens ({mode}, seed {args.seed})",
        file=sys.stderr,
    )
    print(args.prompt + sampler.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
