"""Document-masked attention (data.document_mask): boundaries, the reference model, HF.

- The boundaries read from a window's tokens (data/documents.py) equal the documents packing
  put there, for the three kinds of tokenizer (BOS distinct from EOS, no BOS, BOS == EOS).
- The reference model's packed forward gives every document the logits of a separate forward
  of that document alone (fp32, CPU), and Hugging Face's Llama run on each document alone
  gives the same logits too; the packed training loss is the token mean over the documents.
- The embedded corpus and data=synthetic produce the boundaries their documents have, and
  the loader's order does not depend on document masking.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.config import DataConfig
from data.documents import DocumentBoundaries, Documents, document_starts
from data.loader import build_loader
from data.packing import pack_dataset
from data.sources import embedded_dataset, synthetic_tokens
from data.tokenizer import ByteTokenizer, SyntheticVocabulary, documents_to_ids
from model.config import ModelConfig
from model.hf import hf_config, to_hf_state_dict
from model.init import init_weights
from model.llama import Llama

SEQ = 40


class ListTokenizer:
    """documents_to_ids' tokenizer surface over pre-made id lists ("texts" are the lists)."""

    def __init__(self, bos_id, eos_id):
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode_batch(self, texts):
        return texts


def packed_stream(tok, docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The token stream packing writes, and the offset at which each document starts."""
    parts = documents_to_ids(tok, docs, np.dtype(np.int64))
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]])
    return np.concatenate(parts), starts


def random_documents(rng, n, vocab_low, vocab_high, empty=True) -> list[list[int]]:
    lengths = rng.integers(0 if empty else 1, 30, size=n)
    return [rng.integers(vocab_low, vocab_high, size=k).tolist() for k in lengths]


@pytest.mark.parametrize(
    "bos, eos, empty",
    [(256, 257, True), (None, 257, True), (257, 257, False)],
    ids=["bos-and-eos", "eos-only", "bos-is-eos"],
)
def test_boundaries_from_tokens_equal_the_packed_documents(bos, eos, empty):
    """Every window of the stream: a segment starts exactly at each document start inside it
    (and at the window's first token). With BOS == EOS an empty document cannot be told from
    the stream (documented), so that case packs non-empty documents."""
    rng = np.random.default_rng(0)
    tok = ListTokenizer(bos, eos)
    stream, doc_starts = packed_stream(tok, random_documents(rng, 200, 0, 256, empty))
    n = len(stream) // (SEQ + 1)
    rows = stream[: n * (SEQ + 1)].reshape(n, SEQ + 1)
    got = document_starts(rows[:, :-1], bos, eos)
    want = np.zeros_like(got)
    for s in doc_starts:
        row, col = divmod(int(s), SEQ + 1)
        if row < n and col < SEQ:
            want[row, col] = True
    want[:, 0] = True
    assert got.sum() > 2 * n  # several documents per window: the check means something
    np.testing.assert_array_equal(got, want)


def test_documents_fields_and_micro_batches():
    inputs = torch.tensor([[256, 5, 6, 257, 256, 7, 8, 9], [1, 2, 257, 256, 3, 257, 256, 4]])
    d = Documents.from_inputs(inputs, 256, 257)
    assert d.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 0, 1]]
    assert d.cu_seqlens.tolist() == [0, 4, 8, 11, 14, 16]
    assert d.cu_seqlens.dtype == torch.int32 and d.max_seqlen == 4 and not d.whole_rows
    first, second = d.chunk(2)
    assert first.cu_seqlens.tolist() == [0, 4, 8] and second.cu_seqlens.tolist() == [0, 3, 6, 8]
    assert torch.equal(torch.cat([first.positions, second.positions]), d.positions)
    one_each = Documents.from_inputs(torch.tensor([[256, 1, 2], [3, 4, 5]]), 256, 257)
    assert one_each.whole_rows and one_each.max_seqlen == 3


def tiny_cfg(**kw) -> ModelConfig:
    return ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        vocab_size=300,
        pad_vocab_multiple=128,
        max_seq_len=64,
        **kw,
    )


def packed_batch(rows=3, seed=1):
    """Rows of 40 tokens from a stream of short documents (BOS 256, EOS 257), so documents
    start mid-row and some are cut by the row's start."""
    rng = np.random.default_rng(seed)
    stream, _ = packed_stream(ListTokenizer(256, 257), random_documents(rng, 40, 0, 256))
    inputs = torch.from_numpy(stream[: rows * SEQ].reshape(rows, SEQ).copy())
    return inputs, Documents.from_inputs(inputs, 256, 257)


def segments(documents: Documents):
    """(row, start, end) of every segment."""
    seq = documents.positions.shape[1]
    bounds = documents.cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        row, start = divmod(a, seq)
        yield row, start, start + (b - a)


def test_reference_packed_logits_equal_each_document_alone():
    cfg = tiny_cfg()
    model = Llama(cfg).eval()
    init_weights(model, cfg, 0)
    inputs, docs = packed_batch()
    assert docs.segments >= 3 * inputs.shape[0]
    with torch.no_grad():
        packed = model(inputs, documents=docs)
        causal = model(inputs)
        worst = 0.0
        for row, start, end in segments(docs):
            alone = model(inputs[row : row + 1, start:end])[0]
            worst = max(worst, (packed[row, start:end] - alone).abs().max().item())
    print(f"packed vs separate documents: max abs logits diff {worst:.2e}")
    assert worst < 1e-5
    # Masking matters here: whole-row causal attention gives other logits after a boundary.
    assert (packed - causal).abs().max().item() > 1e-2


def test_reference_packed_loss_is_the_token_mean_over_documents():
    """The training loss (fused head) with documents equals cross entropy of the separate
    documents' logits, weighted by their tokens; and its gradients flow only inside."""
    cfg = tiny_cfg()
    model = Llama(cfg)
    init_weights(model, cfg, 0)
    inputs, docs = packed_batch(rows=2, seed=3)
    labels = torch.roll(inputs, -1, dims=1)
    loss = model(inputs, labels=labels, documents=docs)
    with torch.no_grad():
        total = 0.0
        for row, start, end in segments(docs):
            logits = model(inputs[row : row + 1, start:end])[0, :, : cfg.vocab_size]
            total += F.cross_entropy(logits, labels[row, start:end], reduction="sum").item()
    assert loss.item() == pytest.approx(total / labels.numel(), rel=1e-5)


def test_whole_row_documents_are_the_causal_path():
    cfg = tiny_cfg()
    model = Llama(cfg).eval()
    init_weights(model, cfg, 0)
    inputs = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    inputs[:, 0] = 256
    docs = Documents.from_inputs(inputs, 256, 257)
    assert docs.whole_rows
    with torch.no_grad():
        assert torch.equal(model(inputs, documents=docs), model(inputs))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_on_each_document_alone_equals_our_packed_forward(tied):
    from transformers import LlamaForCausalLM

    cfg = tiny_cfg(tie_embeddings=tied)
    ours = Llama(cfg).eval()
    init_weights(ours, cfg, 5)
    conf = hf_config(cfg)
    conf._attn_implementation = "eager"
    hf = LlamaForCausalLM(conf).float().eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg), strict=False)
    inputs, docs = packed_batch(rows=2, seed=7)
    with torch.no_grad():
        packed = ours(inputs, documents=docs)[..., : cfg.vocab_size]
        worst = 0.0
        for row, start, end in segments(docs):
            alone = hf(inputs[row : row + 1, start:end]).logits[0]
            worst = max(worst, (packed[row, start:end] - alone).abs().max().item())
    print(f"HF per document vs ours packed ({'tied' if tied else 'untied'}): {worst:.2e}")
    assert worst < 1e-4


def test_embedded_corpus_boundaries_are_its_files():
    """Segments of the embedded corpus's windows start exactly where its files start."""
    cfg = DataConfig(max_bytes=300_000)
    tok = ByteTokenizer()
    ds = embedded_dataset(cfg)
    stream = pack_dataset(ds, tok, "text")
    lengths = [len(t.encode("utf-8")) + 2 for t in ds["text"]]
    file_starts = set(np.cumsum([0] + lengths[:-1]).tolist())
    seq = 1024
    n = len(stream) // (seq + 1)
    rows = stream[: n * (seq + 1)].reshape(n, seq + 1)[:, :-1]
    starts = document_starts(rows, tok.bos_id, tok.eos_id)
    r, c = np.nonzero(starts[:, 1:])
    assert {int(i) * (seq + 1) + int(j) + 1 for i, j in zip(r, c)} == {
        s for s in file_starts if s % (seq + 1) not in (0, seq)
    }


@pytest.mark.parametrize("dist, mean", [("fixed", 64), ("exponential", 64), ("exponential", 512)])
def test_synthetic_documents_have_the_asked_lengths(dist, mean):
    cfg = DataConfig(name="synthetic", doc_len=mean, doc_len_dist=dist, max_bytes=400_000)
    tok = ByteTokenizer()
    tokens = synthetic_tokens(cfg, tok)
    assert len(tokens) == cfg.max_bytes and tokens.dtype == np.uint16
    starts = np.flatnonzero(tokens == tok.bos_id)
    lengths = np.diff(starts)
    assert (tokens[starts[1:] - 1] == tok.eos_id).all()  # every document ends with EOS
    if dist == "fixed":
        assert (lengths == mean).all()
    else:  # geometric: mean `mean`, standard deviation about as large
        assert abs(lengths.mean() / mean - 1) < 0.05 and lengths.std() > 0.8 * mean
        assert lengths.min() >= 2


def emitted_starts(loader, steps: int) -> list[int]:
    """Stream offsets where the loader's boundary rule starts a document inside a row
    (shuffle off, one rank: row k of the order is stream[k * (seq + 1): ...])."""
    sample = loader.sample_len
    out = []
    for t in range(steps):
        rows = loader.next_batch()
        positions = loader.boundaries(rows[:, :-1]).positions
        for r, c in zip(*np.nonzero(positions.numpy()[:, 1:] == 0)):
            out.append((t * len(rows) + int(r)) * sample + int(c) + 1)
    return out


def inner_starts(stream: np.ndarray, starts: np.ndarray, sample: int, steps_rows: int) -> list:
    """The document starts of `stream` that the first `steps_rows` rows hold inside a row."""
    end = steps_rows * sample
    return [int(s) for s in starts if s < end and s % sample not in (0, sample - 1)]


@pytest.mark.parametrize("doc_len, rows_per_doc", [(4096, 1), (10_000, 3)])
def test_whole_row_documents_leave_no_boundary_inside_a_row(doc_len, rows_per_doc):
    """doc_len_dist=whole_rows at seq 4096: each document fills whole samples (as long as the
    sequence or longer), so no row of any batch holds a boundary; the same lengths drawn as
    fixed documents do."""
    tok = SyntheticVocabulary(1000)
    cfg = DataConfig(
        name="synthetic",
        seq_len=4096,
        doc_len=doc_len,
        doc_len_dist="whole_rows",
        max_bytes=300_000,
    )
    sample = cfg.seq_len + 1
    tokens = synthetic_tokens(cfg, tok)
    starts = np.flatnonzero(tokens == tok.bos_id)
    np.testing.assert_array_equal(starts, np.arange(0, len(tokens), rows_per_doc * sample))
    assert (tokens[starts[1:] - 1] == tok.eos_id).all()
    loader = build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    for _ in range(loader.samples_per_epoch // 4 + 2):  # past an epoch, shuffled
        rows = loader.next_batch()
        docs = loader.boundaries(rows[:, :-1])
        assert docs.whole_rows and docs.max_seqlen == cfg.seq_len
        if rows_per_doc == 1:  # each sample is one document: BOS first, EOS the last label
            assert (rows[:, 0] == tok.bos_id).all() and (rows[:, -1] == tok.eos_id).all()
    fixed = build_loader(
        dataclasses.replace(cfg, doc_len_dist="fixed"),
        tok,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
    )
    assert not all(fixed.boundaries(fixed.next_batch()[:, :-1]).whole_rows for _ in range(4))


@pytest.mark.parametrize("mean, sigma", [(512, 1.0), (2048, 0.5)])
def test_lognormal_lengths_follow_the_distribution(mean, sigma):
    """doc_len_dist=lognormal: over the n whole documents of a 1M-token stream, the mean of
    ln(length) is within 3 sigma / sqrt(n) of ln(doc_len) - sigma^2 / 2 (its expectation),
    their standard deviation within 5% of sigma, the mean length within 10% of doc_len; the
    stream is the same on every build (seeded) and the loader's boundaries are its documents."""
    tok = SyntheticVocabulary(1000)
    cfg = DataConfig(
        name="synthetic",
        seq_len=1024,
        doc_len=mean,
        doc_len_dist="lognormal",
        doc_len_sigma=sigma,
        max_bytes=1_000_000,
        shuffle=False,
    )
    tokens = synthetic_tokens(cfg, tok)
    assert len(tokens) == cfg.max_bytes and tokens.dtype == np.uint16
    assert tokens[tokens < tok.bos_id].max() > 900  # ids from the whole ordinary range
    starts = np.flatnonzero(tokens == tok.bos_id)
    assert (tokens[starts[1:] - 1] == tok.eos_id).all()
    lengths = np.diff(starts)
    logs, n = np.log(lengths), len(lengths)
    assert abs(logs.mean() - (np.log(mean) - sigma**2 / 2)) < 3 * sigma / np.sqrt(n)
    assert abs(logs.std() / sigma - 1) < 0.05
    assert abs(lengths.mean() / mean - 1) < 0.10 and lengths.min() >= 2
    np.testing.assert_array_equal(synthetic_tokens(cfg, tok), tokens)
    other = synthetic_tokens(dataclasses.replace(cfg, doc_len_sigma=sigma * 1.5), tok)
    assert not np.array_equal(np.flatnonzero(other == tok.bos_id)[:50], starts[:50])

    loader = build_loader(cfg, tok, global_batch_size=8, dp_rank=0, dp_size=1)
    steps = loader.samples_per_epoch // 8
    want = inner_starts(tokens, starts, loader.sample_len, steps * 8)
    assert emitted_starts(loader, steps) == want and len(want) > 0.9 * n


def joined_reference(texts: list[str], min_len: int) -> list[str]:
    """Files joined greedily in order until a document has min_len tokens (bytes + BOS and
    EOS); a short rest joins the last one. Built from the texts, without data.packing."""
    groups, group, size = [], [], 0
    for text in texts:
        group.append(text)
        size += len(text.encode("utf-8")) + (2 if len(group) == 1 else 0)
        if size >= min_len:
            groups.append(group)
            group, size = [], 0
    if group:
        groups[-1] += group
    return ["".join(g) for g in groups]


def test_joined_embedded_files_are_the_documents_masking_sees():
    """data=embedded with data.min_doc_len: consecutive files joined (no BOS/EOS between
    them) into documents of at least min_doc_len tokens; the loader's rows are that stream
    and its boundaries are the joined documents' starts; the held-out batches are joined
    held-out files."""
    from data.loader import build_eval_batches
    from data.sources import held_out_mask, stdlib_documents
    from tests.test_data import expected_stream

    tok = ByteTokenizer()
    cfg = DataConfig(max_bytes=1_000_000, min_doc_len=30_000, seq_len=1024, shuffle=False)
    _, texts = stdlib_documents(cfg.max_bytes)
    joined = joined_reference(texts, cfg.min_doc_len)
    assert 8 < len(joined) < len(texts) / 2
    assert min(len(j.encode("utf-8")) + 2 for j in joined) >= cfg.min_doc_len
    stream = expected_stream(tok, joined)
    loader = build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    steps = loader.samples_per_epoch // 4
    assert loader.samples_per_epoch == len(stream) // loader.sample_len
    starts = np.flatnonzero(stream == tok.bos_id)
    want = inner_starts(stream, starts, loader.sample_len, steps * 4)
    assert emitted_starts(loader, steps) == want
    rows = build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1).next_batch()
    np.testing.assert_array_equal(rows.numpy().reshape(-1), stream[: 4 * loader.sample_len])

    held = [t for t, out in zip(texts, held_out_mask(len(texts), 0.2)) if out]
    ref = expected_stream(tok, joined_reference(held, cfg.min_doc_len))
    ev = build_eval_batches(
        dataclasses.replace(cfg, eval_fraction=0.2),
        tok,
        batches=2,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
    )
    np.testing.assert_array_equal(ev.numpy().reshape(-1), ref[: 8 * loader.sample_len])


@pytest.mark.parametrize(
    "kw",
    [
        dict(name="synthetic", doc_len=300, doc_len_dist="lognormal", doc_len_sigma=0.7),
        dict(name="synthetic", doc_len=100, doc_len_dist="whole_rows"),
        dict(name="embedded", min_doc_len=3000),
    ],
    ids=["lognormal", "whole_rows", "embedded-joined"],
)
def test_long_document_sources_resume_exactly(kw):
    """A fresh loader given the saved position continues the order bit for bit (2 ranks
    saved, 1 resumed; past an epoch boundary)."""
    tok = SyntheticVocabulary(258) if kw["name"] == "synthetic" else ByteTokenizer()
    cfg = DataConfig(seq_len=128, max_bytes=60_000, shuffle_seed=5, **kw)
    one = build_loader(cfg, tok, global_batch_size=8, dp_rank=0, dp_size=1)
    total = one.samples_per_epoch // 8 + 4
    ref = [one.next_batch() for _ in range(total)]
    two = [build_loader(cfg, tok, global_batch_size=8, dp_rank=r, dp_size=2) for r in (0, 1)]
    k = total - 6
    for t in range(k):
        assert torch.equal(torch.cat([ld.next_batch() for ld in two]), ref[t])
    resumed = build_loader(cfg, tok, global_batch_size=8, dp_rank=0, dp_size=1)
    resumed.load_state_dict(two[0].state_dict())
    for t in range(k, total):
        assert torch.equal(resumed.next_batch(), ref[t]), t


def test_loader_order_does_not_depend_on_document_masking():
    tok = ByteTokenizer()
    layout = dict(global_batch_size=4, dp_rank=0, dp_size=1)
    on = build_loader(DataConfig(max_bytes=200_000, document_mask=True), tok, **layout)
    off = build_loader(DataConfig(max_bytes=200_000, document_mask=False), tok, **layout)
    assert off.boundaries is None and isinstance(on.boundaries, DocumentBoundaries)
    for _ in range(3):
        assert torch.equal(on.next_batch(), off.next_batch())
    assert on.state_dict() == off.state_dict()


def test_boundaries_of_a_tokenizer_surface():
    """DocumentBoundaries takes the ids from a tokenizer's surface (HFTokenizer has the same)."""
    tok = SimpleNamespace(bos_id=None, eos_id=9)
    docs = DocumentBoundaries(tok.bos_id, tok.eos_id)(torch.tensor([[1, 9, 2, 3, 9, 9, 4]]))
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0, 0]]


@pytest.mark.parametrize("streaming", [False, True], ids=["token-cache", "streaming"])
def test_hf_data_boundaries_are_the_documents(tmp_path, streaming):
    """data=hf through the memmap token cache and the streaming path, with an AutoTokenizer
    that has BOS and EOS and documents whose text spells them out: every batch's segments
    start exactly where the documents start in the packed stream."""
    import json

    from data.tokenizer import build_tokenizer
    from tests.test_data import make_local_tokenizer

    tok = build_tokenizer(DataConfig(tokenizer=make_local_tokenizer(tmp_path / "tok")))
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "[BOS]", "[EOS]"]
    rng = np.random.default_rng(4)
    texts = [" ".join(rng.choice(words, size=int(k))) for k in rng.integers(1, 12, size=80)]
    (tmp_path / "d").mkdir()
    with open(tmp_path / "d" / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    lengths = [len(tok.encode(t)) + 2 for t in texts]
    doc_starts = set(np.cumsum([0] + lengths[:-1]).tolist())
    seq, G = 15, 4
    cfg = DataConfig(
        name="hf",
        path=str(tmp_path / "d"),
        tokenizer=str(tmp_path / "tok"),
        seq_len=seq,
        shuffle=False,
        streaming=streaming,
        cache_dir=str(tmp_path / "cache"),
    )
    loader = build_loader(cfg, tok, global_batch_size=G, dp_rank=0, dp_size=1)
    for t in range(sum(lengths) // ((seq + 1) * G)):
        rows = loader.next_batch()
        positions = loader.boundaries(rows[:, :-1]).positions
        for r in range(G):
            offset = (t * G + r) * (seq + 1)
            want = [i == 0 or (offset + i) in doc_starts for i in range(seq)]
            assert (positions[r] == 0).tolist() == want, (t, r)


def test_evaluate_with_documents_is_the_mean_of_document_masked_losses():
    """steps.evaluate with the boundary rule: each held-out batch split into micro batches,
    each with its own documents, averaged; equals the model's document-masked loss per batch."""
    from steps import BatchLayout, evaluate

    cfg = tiny_cfg()
    model = Llama(cfg)
    init_weights(model, cfg, 0)
    rows = torch.cat([packed_batch(rows=4, seed=s)[0] for s in (11, 12)]).view(2, 4, SEQ)
    boundaries = DocumentBoundaries(256, 257)
    got = evaluate(model, rows, micro_batches=2, layout=BatchLayout(boundaries))
    want, causal = [], []
    with torch.no_grad():
        for batch in rows:
            for part in batch.chunk(2):
                x, y = part[:, :-1], part[:, 1:]
                want.append(model(x, labels=y, documents=boundaries(x)).item())
                causal.append(model(x, labels=y).item())
    assert got == pytest.approx(sum(want) / len(want), rel=1e-6)
    assert abs(got - sum(causal) / len(causal)) > 1e-3
