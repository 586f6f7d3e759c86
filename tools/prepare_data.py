"""Tokenize a data=hf dataset once into the token cache that train.py memory-maps.

    python tools/prepare_data.py data=hf data.path=HuggingFaceFW/fineweb-edu \\
        data.subset=sample-10BT data.tokenizer=meta-llama/Llama-3.1-8B data.num_proc=16
    python tools/prepare_data.py experiment=llama3_8b_fineweb data.num_proc=16
    python tools/prepare_data.py --force data=hf ...   # tokenize again: measures tokens/s
    python tools/prepare_data.py --list data.cache_dir=/shared/hf-cache

Takes the same overrides as train.py (the `data` group matters, and eval.every: with
evaluation on, the documents held out for it (data.eval_fraction) are not part of the training
entry, as in train.py; data.seq_len does not: one cache entry serves every sequence length). Prints datasets' progress bar while it
tokenizes, then one line with tokens/s, then a report of the entry. If the entry exists, it
only prints the report (with the tokens/s recorded when it was prepared); if another process
is preparing it, it waits for that one. train.py prepares a missing entry by itself, the same
way; running this first keeps the tokenization out of the training job.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config import compose_config  # noqa: E402
from data.sources import check_text_field, hf_dataset, training_documents  # noqa: E402
from data.token_cache import cache_root, list_entries, load_tokens  # noqa: E402
from data.tokenizer import build_tokenizer  # noqa: E402
from errors import ConfigError, one_line  # noqa: E402


def report(meta: dict, tokens_path: Path, seq_len: int) -> str:
    n = int(meta["num_tokens"])
    p = meta.get("prepared", {})
    src = meta.get("source", {})
    where = " ".join(f"{k}={v}" for k, v in src.items() if v is not None)
    return "\n".join(
        [
            f"entry      {tokens_path}",
            f"source     {where}",
            f"tokenizer  {meta.get('tokenizer')} ({meta['tokenizer_fingerprint']}, "
            f"vocab {meta.get('vocab_size')}, {meta['dtype']})",
            f"tokens     {n:,} in {meta.get('num_documents', 0):,} documents "
            f"({n * (2 if meta['dtype'] == 'uint16' else 4) / 2**30:.2f} GiB)",
            f"samples    {n // (seq_len + 1):,} at data.seq_len={seq_len} "
            "(any seq_len reads this entry)",
            f"prepared   {p.get('at')} on {p.get('host')} with num_proc={p.get('num_proc')}: "
            f"{p.get('seconds')} s, {p.get('tokens_per_s', 0):,} tokens/s",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument(
        "--force", action="store_true", help="tokenize again even if the entry exists"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the entries of the cache directory and exit"
    )
    args = parser.parse_args(argv)
    try:
        try:
            full = compose_config(args.overrides)
            cfg = full.data
        except Exception as e:  # Hydra: unknown group or key, bad value
            raise ConfigError(f"bad override ({one_line(e)}); use train.py's overrides") from None
        if args.list:
            root = cache_root(cfg)
            entries = list_entries(root) if root.is_dir() else []
            print(f"{root}: {len(entries)} entries")
            for path, meta, state in entries:
                if meta is None:
                    print(f"  {path.name}: {state}")
                    continue
                src = meta.get("source", {})
                print(
                    f"  {path.stem}: {src.get('path')} {src.get('subset') or ''} "
                    f"{src.get('split')} | {meta.get('tokenizer')} | "
                    f"{int(meta.get('num_tokens', 0)):,} tokens | "
                    f"{meta.get('prepared', {}).get('tokens_per_s', 0):,} tokens/s | {state}"
                )
            return 0
        if cfg.name != "hf":
            raise ConfigError(
                f"data.name={cfg.name!r}: only data=hf is prepared (data=embedded is built in "
                "memory at run time); pass data=hf data.path=..."
            )
        if cfg.streaming:
            raise ConfigError(
                "data.streaming=true reads the stream at run time and has nothing to prepare; "
                "set data.streaming=false"
            )
        tok = build_tokenizer(cfg)
        ds = hf_dataset(cfg)
        check_text_field(ds, cfg)
        if full.eval.every > 0 and cfg.eval_split is None:
            ds = training_documents(ds, cfg)  # what train.py's loader reads
        _, meta, entry = load_tokens(cfg, ds, tok, force=args.force)
        print(report(meta, entry.tokens, cfg.seq_len), flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
