"""Hugging Face weights in and out of training: `model.init_from` and the export command.

In (train.py steps 2 and 7):

    folder = resolve_init_from(cfg.model.init_from, weights=True)   # local folder or hub name
    mcfg = model_config_for_hf(cfg.model, read_hf_config(folder))   # model=hf fills, else checks
    ... build, parallelize, materialize ...
    load_hf_weights(model, mcfg, folder)                            # in place of init_weights

Every rank reads only the entries its parameters hold: for each parameter (a DTensor under
any layout, fc1's _StridedShard under TP included, or a plain tensor) the global indices of its
local entries along each dim (parallel/indices.py `local_global_indices`, the same reading
of placements DCP uses) are mapped to HF rows by model/hf.py's layout table, and read as
blocks with `safe_open(...).get_slice(name)[rows, cols]`. Nothing goes through TE-specific
code: both implementations have the same parameter names and placements, and TE weights of a
quantized_init recipe are cast afterwards from these values by `Recipe.prepare_weights`,
exactly as from the seeded init. (torch DCP's HuggingFaceStorageReader loads HF tensors under
their own names and shapes; our QKV and fc1 interleave several HF tensors row by row, which a
DCP read item cannot express, so the rows are read here.)

Out (tools/convert_hf.py export):

    export_checkpoint("runs/<name>/checkpoints/step_0000100", "out/hf")

reads the checkpoint's config.yaml (model shape, data.tokenizer), loads the model weights from
DCP into plain full tensors in this one process (no trainer, no process group: fc1 saved as two
row blocks per TP rank is still one global [gate; up] tensor in DCP's metadata), and writes an
HF folder: safetensors shards planned by `huggingface_hub.split_torch_state_dict_into_shards`
(+ model.safetensors.index.json when sharded), written one shard at a time, so memory holds one
shard and the tensors it needs, not the whole model; config.json and generation_config.json
with BOS/EOS; the tokenizer files.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from checkpoint import store
from checkpoint.config import CheckpointConfig
from checkpoint.resume import resumes
from errors import ConfigError, one_line
from model.config import ModelConfig
from model.hf import (
    check_hf_names,
    check_shape,
    fill_from_hf,
    hf_config,
    hf_shapes,
    hf_sources,
    hf_tensor,
    model_config_for_hf,
    our_shapes,
    weight_layout,
)
from model.init import canonical_name
from parallel.indices import local_global_indices

#: What a hub download of init_from fetches: configs, weights, tokenizer files.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]
#: How long the other ranks wait for rank 0's download (a 70B model is ~140 GB).
DOWNLOAD_TIMEOUT = timedelta(hours=6)
INDEX_FILE = "model.safetensors.index.json"

# DCP warns that no process group is used; the export reads in one process on purpose.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")


# ---------------------------------------------------------------------------------------------
# Where the weights are.


def resolve_hf_folder(spec: str, *, weights: bool, local_files_only: bool = False) -> Path:
    """A local folder as it is; anything else is a hub name, fetched into the Hugging Face
    cache with `snapshot_download` (weights=False: config.json only)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if spec.startswith((".", "/", "~")) or path.exists():
        raise ConfigError(
            f"model.init_from={spec}: no such folder; pass a Hugging Face model folder "
            "(config.json + *.safetensors) or a hub name"
        )
    from huggingface_hub import snapshot_download

    try:
        got = snapshot_download(
            spec,
            allow_patterns=HUB_PATTERNS if weights else ["config.json"],
            local_files_only=local_files_only,
        )
    except Exception as e:  # no network, unknown or gated repo, ...: all mean "unusable"
        raise ConfigError(
            f"model.init_from={spec} is not a local folder and could not be fetched from the "
            f"Hugging Face hub ({one_line(e)}); pass a local folder, or a hub name (set "
            "HF_TOKEN for gated models)"
        ) from None
    return Path(got)


def from_rank0(fn: Callable[[], Any], timeout: timedelta = DOWNLOAD_TIMEOUT) -> Any:
    """fn() on rank 0 only; every rank returns its result, or raises its ConfigError (so a bad
    input fails on every rank together). The others wait on a gloo group of their own with
    `timeout`, longer than a download, rather than on the training backend's default."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    group = dist.new_group(backend="gloo", timeout=timeout)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except ConfigError as e:
            box = [("config", str(e))]
        except Exception as e:
            box = [("crash", repr(e))]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    kind, value = box[0]
    if kind == "config":
        raise ConfigError(value)
    if kind == "crash":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def resolve_init_from(spec: str, *, weights: bool) -> Path:
    """`model.init_from` -> a local folder on every rank. A hub name is downloaded by rank 0
    first while the others wait; each other rank then resolves the name against its own cache
    (a no-op on a shared cache, a download of its own on a node-local one)."""
    folder = from_rank0(lambda: resolve_hf_folder(spec, weights=weights))
    if dist.is_initialized() and dist.get_rank() != 0 and not Path(spec).expanduser().is_dir():
        try:
            folder = resolve_hf_folder(spec, weights=weights, local_files_only=True)
        except ConfigError:
            folder = resolve_hf_folder(spec, weights=weights)
    return Path(folder)


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.init_from: {folder} has no config.json; pass a Hugging Face folder"
        )
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------
# In: HF safetensors -> the sharded model.


def hf_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder: those its index lists, else every *.safetensors.
    Checked at start-up (train.py step 2) so a missing file fails before anything is built."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(
                f"model.init_from: {folder} lacks {missing[0]} (listed in {INDEX_FILE}); "
                "download the folder again"
            )
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise ConfigError(
            f"model.init_from: {folder} has no *.safetensors weights; convert .bin "
            "checkpoints to safetensors first"
        )
    return [folder / n for n in names]


class SafetensorsFolder:
    """Lazy access to the tensors of an HF folder's safetensors files (sharded with an index, or
    not). Use as a context manager; `get(name, rows, cols)` reads only that block."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._files = hf_weight_files(self.folder)
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsFolder:
        from safetensors import safe_open

        for f in self._files:
            handle = self._stack.enter_context(safe_open(f, framework="pt"))
            self._where.update(dict.fromkeys(handle.keys(), handle))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def get(self, name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        part = self._where[name].get_slice(name)
        return part[rows] if cols is None else part[rows, cols]


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, cfg: ModelConfig, folder: str | Path) -> float:
    """Every parameter of `model` (any implementation, any layout, materialized) from the HF
    folder: this rank's entries only, cast to the parameter's dtype. Call on every rank, in
    place of `init_weights`. Returns the seconds it took."""
    t0 = time.perf_counter()
    layout, shapes = weight_layout(cfg), hf_shapes(cfg)
    with SafetensorsFolder(folder) as src:
        check_hf_names(src.names(), shapes, cfg, f"model.init_from {folder}")
        for name, want in shapes.items():
            check_shape(src.shape(name), want, name)
        for fqn, p in model.named_parameters():
            name = canonical_name(fqn)
            if name not in layout:
                raise ValueError(f"parameter {name!r} has no Hugging Face counterpart")
            local = p.to_local() if isinstance(p, DTensor) else p
            index = (
                local_global_indices(p)
                if isinstance(p, DTensor)
                else [torch.arange(s) for s in p.shape]
            )
            fill_from_hf(local, layout[name], index, src.get)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Out: a committed DCP checkpoint -> an HF folder.


BYTE_BOS, BYTE_EOS = "<|bos|>", "<|eos|>"


def _byte_symbols() -> list[str]:
    """The character that byte-level (GPT-2 style) pre-tokenization maps each byte 0..255 to:
    printable Latin-1 bytes stand for themselves, the 68 others take the code points 256, 257,
    ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, spare = [], 256
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(spare))
            spare += 1
    return symbols


def byte_tokenizer(model_max_length: int):
    """data/tokenizer.py's ByteTokenizer as a `PreTrainedTokenizerFast`: token id = UTF-8 byte,
    then BOS (256) and EOS (257). A byte-level pre-tokenizer turns the text into one symbol per
    byte and a BPE model without merges maps each symbol to its byte's id. Special-token text
    in the input is split into bytes (split_special_tokens), as ByteTokenizer does, so
    `encode(text)` gives ByteTokenizer's ids for any text; no BOS is added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from data.tokenizer import ByteTokenizer

    vocab = {s: b for b, s in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BYTE_BOS, BYTE_EOS)]
    )
    ids = (tok.token_to_id(BYTE_BOS), tok.token_to_id(BYTE_EOS))
    assert ids == (ByteTokenizer.bos_id, ByteTokenizer.eos_id), ids
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BYTE_BOS,
        eos_token=BYTE_EOS,
        model_max_length=model_max_length,
        split_special_tokens=True,
    )


def export_tokenizer(spec: str, model_max_length: int):
    """The tokenizer of a run (data.tokenizer) as a transformers tokenizer to save, with its
    BOS and EOS ids."""
    if spec == "byte":
        tok = byte_tokenizer(model_max_length)
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(spec)
        except Exception as e:
            raise ConfigError(
                f"the run's tokenizer {spec!r} cannot be loaded ({one_line(e)}); pass "
                "--tokenizer <name or folder>"
            ) from None
    return tok, tok.bos_token_id, tok.eos_token_id


def _model_config(saved: dict, path: Path) -> ModelConfig:
    from omegaconf import OmegaConf

    try:
        merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), saved.get("model") or {})
        return OmegaConf.to_object(merged)
    except Exception as e:
        raise ConfigError(
            f"checkpoint {path}: its config.yaml has no usable model section ({one_line(e)})"
        ) from None


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and owning its storage (a vocabulary slice or a gate/up half is a view)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: str | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the model of a committed checkpoint as a Hugging Face folder (module docstring).

    checkpoint: a step_XXXXXXX folder, or a folder holding them (its newest complete one).
    dtype: of the written weights (default: as saved, fp32). tokenizer: default the run's
    data.tokenizer. Quantized-weight checkpoints (recipe.quantized_init) export the optimizer's
    fp32 master weights. Returns the checkpoint folder exported.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import load as dcp_load
    from transformers import GenerationConfig

    path, saved, cfg, md, entries = _open_checkpoint(checkpoint, "export an earlier one")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; remove it or pick another output folder")
    dtype = dtype or md[entries["embed.weight"]].properties.dtype
    tok, bos, eos = export_tokenizer(
        tokenizer or (saved.get("data") or {}).get("tokenizer") or "byte", cfg.max_seq_len
    )

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        request = {
            entries[n]: torch.empty(md[entries[n]].size, dtype=md[entries[n]].properties.dtype)
            for n in names
        }
        if request:
            dcp_load(request, checkpoint_id=str(path), no_dist=True)
        return {n: request[entries[n]] for n in names}

    # Shards are planned on meta tensors (sizes only), then filled one at a time: each of our
    # tensors is read when a shard first needs it and dropped after the last one that does.
    sources = hf_sources(cfg)
    meta = {hf: torch.empty(s, dtype=dtype, device="meta") for hf, s in hf_shapes(cfg).items()}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
    shards = list(split.filename_to_tensors.items())
    last_use = {}
    for i, (_, names) in enumerate(shards):
        last_use.update({ours: i for hf in names for ours, _ in sources[hf]})
    out.mkdir(parents=True, exist_ok=True)
    held: dict[str, torch.Tensor] = {}
    for i, (filename, names) in enumerate(shards):
        need = sorted({ours for hf in names for ours, _ in sources[hf]} - set(held))
        held.update(load(need))
        tensors = {hf: _standalone(hf_tensor(sources[hf], held).to(dtype)) for hf in names}
        save_file(tensors, out / filename, metadata={"format": "pt"})
        _readable_as_others(out / filename)
        held = {k: v for k, v in held.items() if last_use[k] > i}
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    hf_config(cfg, dtype=dtype, bos_token_id=bos, eos_token_id=eos).save_pretrained(out)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(out)
    tok.save_pretrained(out)
    return path


def _readable_as_others(path: Path) -> None:
    """safetensors writes through a private temporary file (mode 0600) that it renames into
    place; give the file the mode any other file of the export gets (0666 less the umask,
    0644 usually), so the others on a shared cluster can read it as they read config.json."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def checkpoint_model_weights(checkpoint: str | Path) -> tuple[ModelConfig, dict, Path, dict]:
    """The model of a committed checkpoint, read in this one process as full tensors (no
    process group, any layout it was saved from): (its ModelConfig, its whole saved config,
    the step folder, {parameter name: tensor}). `checkpoint`: a step folder, a folder holding
    them, or a run directory (its checkpoints/). Quantized-weight checkpoints give the fp32
    master weights. Raises ConfigError (one line)."""
    from torch.distributed.checkpoint import load as dcp_load

    path, saved, cfg, md, entries = _open_checkpoint(checkpoint, "use an earlier one")
    flat = {
        key: torch.empty(md[key].size, dtype=md[key].properties.dtype) for key in entries.values()
    }
    dcp_load(flat, checkpoint_id=str(path), no_dist=True)
    return cfg, saved, path, {name: flat[key] for name, key in entries.items()}


def _open_checkpoint(checkpoint: str | Path, earlier: str):
    """A committed checkpoint opened for reading its model in this one process: (step folder,
    its whole saved config, its ModelConfig, its DCP metadata, {parameter name: the DCP entry
    holding it}: the optimizer's fp32 master weight when quantized, else the model's), each
    weight present with our shape, all checked before anything is read or written. Raises
    ConfigError (one line); `earlier`: what to do with a damaged one."""
    import yaml
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found = store.find_checkpoint(Path(checkpoint).expanduser())
    if found is None:
        raise ConfigError(
            f"{checkpoint}: no committed checkpoint there; pass a run directory (runs/<name>), "
            "a step folder such as runs/<name>/checkpoints/step_0000100, or a folder holding them"
        )
    path = found.path
    problem = store.verify(path, checksum=True)
    if problem:
        raise ConfigError(f"checkpoint {path} is damaged ({problem}); {earlier}")
    config_file = path / store.CONFIG_FILE
    if not config_file.is_file():
        raise ConfigError(f"checkpoint {path} has no {store.CONFIG_FILE}; it names the model shape")
    saved = yaml.safe_load(config_file.read_text()) or {}
    cfg = _model_config(saved, path)
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    entries = {}
    for name, shape in our_shapes(cfg).items():
        master = f"optimizer.state.{name}.master_param"
        key = master if master in md else f"model.{name}"
        if not isinstance(md.get(key), TensorStorageMetadata):
            raise ConfigError(
                f"checkpoint {path} has no tensor {key!r}; it does not match its config.yaml"
            )
        check_shape(md[key].size, shape, key)
        entries[name] = key
    return path, saved, cfg, md, entries


def model_source(
    m: ModelConfig, ck: CheckpointConfig, run_dir: Path
) -> tuple[ModelConfig, Path | None]:
    """Step 2 of train.run: the model config to build, and the Hugging Face folder to load its
    weights from (None: the seeded init).

    With model.init_from set, its config.json gives the shape (model=hf) or must agree with
    the model config (model/hf.py `model_config_for_hf`). Resume wins: when the run will load a
    checkpoint (checkpoint/resume.py's `resumes`: checkpoint.resume is a path, or auto and the
    run's checkpoint directory holds a complete one) the HF weights are neither fetched nor
    loaded, only config.json is read; init_from is used when the run starts at step 0. Rank 0
    decides and fetches first; the others wait for it (`from_rank0`)."""
    if not m.init_from:
        if m.shape_from_hf:
            raise ConfigError(
                "model=hf takes the model shape from model.init_from; set "
                "model.init_from=<Hugging Face folder or hub name>"
            )
        return m, None
    resuming = from_rank0(lambda: resumes(ck, run_dir))
    folder = resolve_init_from(m.init_from, weights=not resuming)
    mcfg = model_config_for_hf(m, read_hf_config(folder))
    if resuming:
        return mcfg, None
    hf_weight_files(folder)  # present before anything is built
    return mcfg, folder
