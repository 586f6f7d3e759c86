"""Tokenizers: the built-in byte-level one and a thin wrapper around `AutoTokenizer`.

Both expose the same small surface (`vocab_size`, `bos_id`, `eos_id`, `encode`, `decode`,
`encode_batch`, `fingerprint`) so packing code never asks which one it holds.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from data.config import DataConfig
from errors import ConfigError, one_line


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 = BOS, 257 = EOS (vocab_size 258, the tiny model's)."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        """Special ids are dropped (they are not bytes); invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class SyntheticVocabulary:
    """data=synthetic's ids, without a tokenizer: ordinary ids 0..vocab_size-3, BOS
    vocab_size-2 and EOS vocab_size-1 (with the tiny model's 258 these are the byte
    tokenizer's ids). It has no text to encode or decode: random ids need only the size."""

    def __init__(self, vocab_size: int):
        if vocab_size < 3:
            raise ConfigError(
                f"model.vocab_size={vocab_size} is too small for data=synthetic (ordinary ids, "
                "then BOS and EOS); set model.vocab_size >= 3"
            )
        self.vocab_size = vocab_size
        self.bos_id = vocab_size - 2
        self.eos_id = vocab_size - 1
        self.fingerprint = f"synthetic-{vocab_size}"


class HFTokenizer:
    """`transformers.AutoTokenizer` behind the ByteTokenizer surface.

    Documents are encoded without the tokenizer's own special tokens; packing adds BOS (if the
    tokenizer has one) and EOS around every document itself, the same way for every tokenizer.
    """

    def __init__(self, name_or_path: str):
        source, local_only = locate_tokenizer(name_or_path)
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        except Exception as e:  # OSError, ValueError, HFValidationError, ...: all mean "unusable"
            raise ConfigError(
                f"data.tokenizer={name_or_path!r} cannot be loaded ({one_line(e)}); set "
                "data.tokenizer=byte or a tokenizer name / local directory with tokenizer files"
            ) from None
        if tok.eos_token_id is None:
            raise ConfigError(
                f"data.tokenizer={name_or_path!r} has no EOS token, which separates packed "
                "documents; use a tokenizer that defines eos_token"
            )
        # Documents are longer than the model's context; packing cuts them, so silence
        # transformers' "sequence length is longer than the maximum" warning.
        tok.model_max_length = 1 << 62
        self._tok = tok
        self.name = name_or_path
        # len() counts added special tokens; tok.vocab_size does not.
        self.vocab_size = len(tok)
        self.eos_id = int(tok.eos_token_id)
        self.bos_id = None if tok.bos_token_id is None else int(tok.bos_token_id)

    @property
    def fingerprint(self) -> str:
        """Identity of the vocabulary and merges, to key caches of tokenized data."""
        h = hashlib.sha256(type(self._tok).__name__.encode())
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None:
            h.update(backend.to_str().encode())
        else:  # slow tokenizer: the vocabulary is the best identity we have
            h.update(repr(sorted(self._tok.get_vocab().items())).encode())
        h.update(repr((self.bos_id, self.eos_id, self.vocab_size)).encode())
        return "hf-" + h.hexdigest()[:16]

    # split_special_tokens: a document that contains the text "<|end_of_text|>" must not
    # inject a real EOS (or any other control token) into the packed stream.
    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(
            texts, add_special_tokens=False, split_special_tokens=True, return_attention_mask=False
        )["input_ids"]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


_TRUE = ("1", "ON", "YES", "TRUE")
_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def hub_offline() -> bool:
    """Downloads from the Hugging Face hub are switched off (HF_HUB_OFFLINE, or
    TRANSFORMERS_OFFLINE, which transformers reads as the same)."""
    return any(
        os.environ.get(v, "").upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _in_cache(repo: str) -> str | None:
    """The local hub cache's snapshot directory of `repo` when it holds its tokenizer files,
    else None (no network). Loaded as a directory: a tokenizer fetched alone (without the
    model's config.json) loads from it, where its hub name would ask the hub for the rest."""
    try:
        from huggingface_hub import try_to_load_from_cache

        for name in ("tokenizer_config.json", "tokenizer.json"):
            found = try_to_load_from_cache(repo, name)
            if isinstance(found, str):
                return os.path.dirname(found)
    except Exception:  # not a valid repo id: the load reports it
        pass
    return None


def hub_unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why the hub's host cannot be reached (one TCP connection, `timeout` seconds), or None.
    With a proxy configured the proxy decides: not probed."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def locate_tokenizer(spec: str) -> tuple[str, bool]:
    """Where `data.tokenizer` loads from, decided without a download: (a local directory,
    True), (the cache's snapshot of a hub name found there, True: loaded without any network
    call), or (a hub name, False) once the hub is known to be reachable. Raises one line otherwise: a
    missing local path, or a hub name that is not cached while offline or unreachable (rather
    than a minute of retries)."""
    expanded = os.path.expanduser(spec)
    if os.path.isdir(expanded):
        return expanded, True
    fixes = (
        "give a local directory with the tokenizer files (data.tokenizer=PATH), or "
        "data.tokenizer=byte"
    )
    if spec.startswith(_LOCAL_PREFIXES) or os.path.isfile(expanded):
        raise ConfigError(
            f"data.tokenizer={spec!r} is not a directory (relative paths start at "
            f"{os.getcwd()}); {fixes}, or a hub name"
        )
    if (snapshot := _in_cache(spec)) is not None:
        return snapshot, True
    from huggingface_hub import constants

    get = f"download it where there is network (hf download {spec} --include 'tokenizer*')"
    if hub_offline():
        raise ConfigError(
            f"data.tokenizer={spec!r} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and downloads are off (HF_HUB_OFFLINE=1); {get}, or "
            f"{fixes}"
        )
    if (why := hub_unreachable(constants.ENDPOINT)) is not None:
        raise ConfigError(
            f"data.tokenizer={spec!r} is not in the local Hugging Face cache and "
            f"{constants.ENDPOINT} cannot be reached ({why}); {get}, or {fixes}"
        )
    return spec, False


def build_tokenizer(
    cfg: DataConfig, vocab_size: int | None = None
) -> ByteTokenizer | HFTokenizer | SyntheticVocabulary:
    """data.tokenizer == "byte" -> ByteTokenizer, else AutoTokenizer from a name or local path.
    data=synthetic loads none, whatever data.tokenizer says: its ids are those of
    `SyntheticVocabulary(vocab_size)` (train.py passes model.vocab_size)."""
    if cfg.name == "synthetic":
        if vocab_size is None:
            raise ValueError("data=synthetic needs the model's vocab_size (no tokenizer is loaded)")
        return SyntheticVocabulary(vocab_size)
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if not cfg.tokenizer:
        raise ConfigError("data.tokenizer is empty; set data.tokenizer=byte or a tokenizer name")
    return HFTokenizer(cfg.tokenizer)


def vocabulary_line(cfg: DataConfig, tok) -> str:
    """What the data's ids come from, for the start-up lines (dry run, data preparation)."""
    if isinstance(tok, SyntheticVocabulary):
        return (
            f"no tokenizer loaded (data=synthetic: random ids, vocabulary {tok.vocab_size} = "
            f"model.vocab_size; data.tokenizer={cfg.tokenizer!r} is not used)"
        )
    return f"tokenizer vocabulary {tok.vocab_size}"


def token_dtype(tok) -> np.dtype:
    """Smallest unsigned dtype holding every id: uint16 up to 65536 ids, else uint32."""
    return np.dtype(np.uint16) if tok.vocab_size <= 1 << 16 else np.dtype(np.uint32)


def documents_to_ids(tok, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """Each document as [BOS] + tokens + [EOS] (BOS only if the tokenizer has one)."""
    head = [] if tok.bos_id is None else [tok.bos_id]
    out = []
    for ids in tok.encode_batch(texts):
        doc = np.empty(len(head) + len(ids) + 1, dtype=dtype)
        doc[: len(head)] = head
        doc[len(head) : -1] = ids
        doc[-1] = tok.eos_id
        out.append(doc)
    return out
