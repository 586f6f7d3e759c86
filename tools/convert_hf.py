"""Export a training checkpoint as a Hugging Face model folder.

    python tools/convert_hf.py export runs/<name>/checkpoints/step_0000100 out/hf
    python tools/convert_hf.py export runs/<name> out/hf --dtype bf16   # newest checkpoint

The checkpoint is any committed DCP step folder (or a folder holding them: its newest one),
from any layout and world size; it is read in this one process, without a GPU or a process
group. The model shape and the tokenizer come from the checkpoint's own config.yaml. The
output folder loads with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`; it holds safetensors weights (sharded past --max-shard-size,
with model.safetensors.index.json), config.json and generation_config.json with BOS/EOS, and
the tokenizer files: the run's Hugging Face tokenizer (data.tokenizer, or --tokenizer), or for
the byte tokenizer a byte-level tokenizer.json with the same ids. Exit status 2 on bad input.

Starting training from Hugging Face weights needs no conversion: `model.init_from=<folder or
hub name>` (docs/CHECKPOINTING.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from checkpoint.hf import export_checkpoint  # noqa: E402
from errors import ConfigError  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cmd_export(args) -> None:
    path = export_checkpoint(
        args.checkpoint,
        args.out,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        tokenizer=args.tokenizer,
        max_shard_size=args.max_shard_size,
    )
    print(f"wrote {args.out} from {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="committed DCP checkpoint -> Hugging Face folder")
    exp.add_argument("checkpoint", help="step_XXXXXXX folder, or a folder holding them")
    exp.add_argument("out", help="output folder (must not exist, or be empty)")
    exp.add_argument("--dtype", choices=sorted(DTYPES), help="weights dtype (default: as saved)")
    exp.add_argument(
        "--tokenizer", help="tokenizer name or folder to write (default: the run's data.tokenizer)"
    )
    exp.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)"
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
