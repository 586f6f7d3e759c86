"""data/: tokenizers, the embedded corpus, HF local files, the global-batch and resume contract."""

from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest
import torch

from config import ConfigError
from data import ByteTokenizer, DataConfig, build_loader, build_tokenizer
from data.packing import pack_dataset
from data.sources import embedded_dataset, stdlib_documents

DOCS = [f"document {i}: " + "héllo wörld, " * (i % 7 + 1) + "x = 1\n" * (i % 5) for i in range(60)]


def tiny_embedded(**kw) -> DataConfig:
    # ~12 KB of stdlib source at seq_len 32: 360 samples, an epoch is ~45 steps of 8 rows.
    base = dict(name="embedded", tokenizer="byte", seq_len=32, max_bytes=12_000, shuffle_seed=3)
    return DataConfig(**{**base, **kw})


def global_batches(cfg, tok, steps, dp_size, G=8, loaders=None):
    """Concatenation of all ranks' rows, step by step: the global batches."""
    loaders = loaders or [
        build_loader(cfg, tok, global_batch_size=G, dp_rank=r, dp_size=dp_size)
        for r in range(dp_size)
    ]
    out = []
    for _ in range(steps):
        parts = [ld.next_batch() for ld in loaders]
        assert all(p.shape == (G // dp_size, cfg.seq_len + 1) for p in parts)
        assert all(p.dtype == torch.int64 for p in parts)
        out.append(torch.cat(parts))
    return out, loaders


def expected_stream(tok, docs) -> np.ndarray:
    """Reference token stream: [BOS] + ids + [EOS] per document, built without data.packing."""
    ids = []
    for d in docs:
        ids += ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(d) + [tok.eos_id]
    return np.array(ids, dtype=np.int64)


# --- tokenizer and embedded corpus ---------------------------------------------------------


def test_byte_tokenizer_roundtrip():
    tok = build_tokenizer(DataConfig(tokenizer="byte"))
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    text = "def f(x):\n    return 'héllo ✓ 漢字'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text  # specials are not bytes


def test_synthetic_data_loads_no_tokenizer(monkeypatch, tmp_path):
    """experiment=llama3_8b_32k data=synthetic offline, with an empty Hugging Face cache: the
    preset's data.tokenizer (a hub name) is not loaded; the ids are the model vocabulary's
    (BOS and EOS its last two ids), and the data log line says that no tokenizer was loaded."""
    from config import compose_config
    from data import SyntheticVocabulary, build_data

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = compose_config(["experiment=llama3_8b_32k", "data=synthetic", "data.max_bytes=1500000"])
    assert cfg.data.tokenizer == "meta-llama/Llama-3.1-8B" and cfg.model.vocab_size == 128256
    tok = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    assert isinstance(tok, SyntheticVocabulary)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (128256, 128254, 128255)
    lines = []
    loader, _ = build_data(
        cfg.data, tok, global_batch_size=8, dp_rank=0, dp_size=1, log=lines.append
    )
    assert lines[0] == (
        "data: preparing data=synthetic (seq_len 32768; documents of 2,048 tokens; no tokenizer "
        "loaded (data=synthetic: random ids, vocabulary 128256 = model.vocab_size; "
        "data.tokenizer='meta-llama/Llama-3.1-8B' is not used))"
    )
    rows = loader.next_batch()
    ordinary = rows[rows < tok.bos_id]
    assert rows.max() == tok.eos_id and ordinary.max() > 120_000 and ordinary.min() < 1000
    assert (rows == tok.bos_id).sum() == (rows == tok.eos_id).sum() > 100  # 2048-token documents


def test_embedded_corpus_deterministic_and_real():
    cfg = DataConfig(name="embedded", max_bytes=2_000_000)
    paths1, texts1 = stdlib_documents(cfg.max_bytes)
    paths2, texts2 = stdlib_documents(cfg.max_bytes)
    assert paths1 == paths2 and texts1 == texts2
    assert len(set(paths1)) == len(paths1) and all(p.endswith(".py") for p in paths1)
    assert not any(
        part in ("test", "tests", "site-packages") for p in paths1 for part in p.split(os.sep)
    )
    total = sum(len(t.encode("utf-8")) for t in texts1)
    assert 1_900_000 < total <= 2_000_000
    joined = "".join(texts1)
    assert joined.count("def ") > 1000 and "import " in joined
    # The first document is the file on disk, byte for byte.
    with open(os.path.join(sysconfig.get_paths()["stdlib"], paths1[0]), encoding="utf-8") as f:
        assert texts1[0] == f.read()

    tok = ByteTokenizer()
    ds = embedded_dataset(cfg)
    assert ds.column_names == ["path", "text"] and ds["text"] == texts1
    a, b = pack_dataset(ds, tok, "text"), pack_dataset(embedded_dataset(cfg), tok, "text")
    assert a.dtype == np.uint16 and np.array_equal(a, b)
    assert len(a) == total + 2 * len(texts1)
    np.testing.assert_array_equal(a[:20_000], expected_stream(tok, texts1)[:20_000])


# --- global batch and resume contract --------------------------------------------------------


def test_global_batch_independent_of_dp_size():
    tok = ByteTokenizer()
    cfg = tiny_embedded()
    ref, (one,) = global_batches(cfg, tok, steps=6, dp_size=1)
    for dp in (2, 4):
        got, _ = global_batches(cfg, tok, steps=6, dp_size=dp)
        for a, b in zip(ref, got):
            assert torch.equal(a, b)
    assert one.samples_consumed == 48
    # Shuffled, not the corpus order, yet made of real packed samples.
    assert len({tuple(r.tolist()) for r in torch.cat(ref)}) == 48
    seq, _ = global_batches(tiny_embedded(shuffle=False), tok, steps=1, dp_size=1)
    assert not torch.equal(seq[0], ref[0])


def test_epoch_is_a_permutation_and_epochs_differ():
    tok = ByteTokenizer()
    cfg = tiny_embedded()
    loader = build_loader(cfg, tok, global_batch_size=8, dp_rank=0, dp_size=1)
    n = loader.samples_per_epoch
    stream = torch.from_numpy(
        pack_dataset(embedded_dataset(cfg), tok, "text")[: n * 33].astype(np.int64)
    )
    all_samples = stream.view(n, 33)
    steps = -(-2 * n // 8)
    rows = torch.cat(global_batches(cfg, tok, steps, 1, loaders=[loader])[0])
    key = lambda t: sorted(tuple(r.tolist()) for r in t)  # noqa: E731
    assert key(rows[:n]) == key(all_samples)  # epoch 0: every sample exactly once
    assert key(rows[n : 2 * n]) == key(all_samples)  # epoch 1 too
    assert not torch.equal(rows[:n], rows[n : 2 * n])  # in a different order
    assert loader.state_dict()["epoch"] == (steps * 8) // n


@pytest.mark.parametrize("save_dp,load_dp,k", [(4, 2, 20), (1, 4, 44), (2, 1, 45)])
def test_resume_is_exact_across_dp_sizes_and_epochs(save_dp, load_dp, k):
    tok = ByteTokenizer()
    cfg = tiny_embedded()
    total = 60  # an epoch is 45 steps of 8 (360 samples): k=44/45 straddle the boundary
    ref, _ = global_batches(cfg, tok, total, dp_size=2)
    first, loaders = global_batches(cfg, tok, k, dp_size=save_dp)
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)  # rank independent: DCP keeps one copy
    state = json.loads(json.dumps(states[0]))  # plain ints/strings only
    assert state["samples_consumed"] == 8 * k
    resumed = [
        build_loader(cfg, tok, global_batch_size=8, dp_rank=r, dp_size=load_dp)
        for r in range(load_dp)
    ]
    for ld in resumed:
        ld.load_state_dict(state)
    rest, _ = global_batches(cfg, tok, total - k, load_dp, loaders=resumed)
    assert len(first + rest) == len(ref)
    for t, (a, b) in enumerate(zip(ref, first + rest)):
        assert torch.equal(a, b), f"global batch {t} differs"


def test_resume_rejects_a_different_sample_layout():
    tok = ByteTokenizer()
    loader = build_loader(tiny_embedded(), tok, global_batch_size=8, dp_rank=0, dp_size=1)
    loader.next_batch()
    state = loader.state_dict()
    other = build_loader(tiny_embedded(seq_len=16), tok, global_batch_size=8, dp_rank=0, dp_size=1)
    with pytest.raises(ConfigError, match=r"^data.seq_len=16 does not match .*seq_len=32"):
        other.load_state_dict(state)
    other = build_loader(
        tiny_embedded(shuffle_seed=4), tok, global_batch_size=8, dp_rank=0, dp_size=1
    )
    with pytest.raises(ConfigError, match="data.shuffle_seed"):
        other.load_state_dict(state)
    other = build_loader(
        tiny_embedded(max_bytes=13_000), tok, global_batch_size=8, dp_rank=0, dp_size=1
    )
    with pytest.raises(ConfigError, match="the data changed"):
        other.load_state_dict(state)


# --- hf: local files ---------------------------------------------------------------------


def write_files(root, kind):
    root.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        for part in range(2):
            with open(root / f"part{part}.jsonl", "w") as f:
                for i in range(part * 30, part * 30 + 30):
                    f.write(json.dumps({"id": i, "text": DOCS[i]}) + "\n")
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for part in range(2):
            rows = range(part * 30, part * 30 + 30)
            pq.write_table(
                pa.table({"id": list(rows), "text": [DOCS[i] for i in rows]}),
                root / f"part{part}.parquet",
            )
    else:
        for i, d in enumerate(DOCS):
            (root / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    (root / "README.md").write_text("not data")  # ignored: not a data extension
    return root


def hf_cfg(tmp_path, path, **kw) -> DataConfig:
    base = dict(
        name="hf",
        path=str(path),
        tokenizer="byte",
        seq_len=32,
        shuffle=False,
        cache_dir=str(tmp_path / "cache"),
    )
    return DataConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_hf_local_files_roundtrip(tmp_path, kind):
    root = write_files(tmp_path / kind, kind)
    tok = ByteTokenizer()
    cfg = hf_cfg(tmp_path, root)
    loader = build_loader(cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    stream = expected_stream(tok, DOCS)
    n = len(stream) // 33
    assert loader.samples_per_epoch == n
    got = torch.cat([loader.next_batch() for _ in range(n // 4)]).flatten().numpy()
    np.testing.assert_array_equal(got, stream[: len(got)])
    text = tok.decode(got)
    assert text.startswith(DOCS[0] + DOCS[1]) and "héllo wörld" in text


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_local_files_load_without_progress_bars(tmp_path, capfd, streaming):
    """Local files are no download: datasets' "Downloading data" and "Generating train split"
    bars (carriage-return updates that fill a log file) are not shown, and the bars are on
    again afterwards for what does download (issue #53)."""
    import datasets

    from data.sources import hf_dataset

    root = write_files(tmp_path / "txt", "txt")
    datasets.enable_progress_bars()
    ds = hf_dataset(hf_cfg(tmp_path, root, streaming=streaming))
    assert sum(1 for _ in ds) == len(DOCS)  # one document per file
    err = capfd.readouterr().err
    assert "\r" not in err and "Downloading" not in err and "Generating" not in err, err
    assert datasets.is_progress_bar_enabled()


def test_hf_glob_and_single_file(tmp_path):
    root = write_files(tmp_path / "j", "jsonl")
    tok = ByteTokenizer()
    ref = build_loader(hf_cfg(tmp_path, root), tok, global_batch_size=4, dp_rank=0, dp_size=1)
    glob = build_loader(
        hf_cfg(tmp_path, root / "part*.jsonl"), tok, global_batch_size=4, dp_rank=0, dp_size=1
    )
    assert torch.equal(ref.next_batch(), glob.next_batch())
    single = build_loader(
        hf_cfg(tmp_path, root / "part1.jsonl"), tok, global_batch_size=4, dp_rank=0, dp_size=1
    )
    np.testing.assert_array_equal(
        single.next_batch()[0].numpy(), expected_stream(tok, DOCS[30:])[:33]
    )


def test_streaming_matches_map_style_and_resumes(tmp_path):
    root = write_files(tmp_path / "j", "jsonl")
    tok = ByteTokenizer()
    map_cfg, stream_cfg = hf_cfg(tmp_path, root), hf_cfg(tmp_path, root, streaming=True)
    n = build_loader(map_cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1).samples_per_epoch
    steps = n // 4 + 3  # past the end of the stream: epoch 1 restarts it
    ref, _ = global_batches(map_cfg, tok, steps, dp_size=1, G=4)
    got, loaders = global_batches(stream_cfg, tok, steps, dp_size=2, G=4)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert loaders[0].state_dict()["epoch"] == 1
    # Resume streaming at a different dp size, mid-epoch 0 and into epoch 1.
    k = n // 4 - 1
    first, old = global_batches(stream_cfg, tok, k, dp_size=4, G=4)
    new = [
        build_loader(stream_cfg, tok, global_batch_size=4, dp_rank=r, dp_size=2) for r in range(2)
    ]
    for ld in new:
        ld.load_state_dict(old[0].state_dict())
    rest, _ = global_batches(stream_cfg, tok, steps - k, 2, G=4, loaders=new)
    for a, b in zip(ref, first + rest):
        assert torch.equal(a, b)
    # Map-style state loads into streaming (same order when unshuffled).
    mid = build_loader(map_cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    for _ in range(k):
        mid.next_batch()
    s = build_loader(stream_cfg, tok, global_batch_size=4, dp_rank=0, dp_size=1)
    s.load_state_dict(mid.state_dict())
    assert torch.equal(s.next_batch(), ref[k])


def test_streaming_shuffled_is_deterministic_and_resumes(tmp_path):
    root = write_files(tmp_path / "j", "jsonl")
    tok = ByteTokenizer()
    cfg = hf_cfg(tmp_path, root, streaming=True, shuffle=True, shuffle_buffer=16, shuffle_seed=7)
    n = build_loader(
        hf_cfg(tmp_path, root), tok, global_batch_size=4, dp_rank=0, dp_size=1
    ).samples_per_epoch
    steps = 2 * (n // 4) + 2
    ref, _ = global_batches(cfg, tok, steps, dp_size=1, G=4)
    unshuffled, _ = global_batches(hf_cfg(tmp_path, root, streaming=True), tok, 2, 1, G=4)
    assert not torch.equal(ref[0], unshuffled[0])
    rows = torch.cat(ref)  # an epoch is n samples, whatever the document order
    epoch0, epoch1 = rows[:n].flatten(), rows[n : 2 * n].flatten()
    assert not torch.equal(epoch0, epoch1)  # reshuffled per epoch
    # Same documents, shuffled: every document appears once per epoch (fully packed ones).
    text0 = tok.decode(epoch0.tolist())
    assert sum(d in text0 for d in DOCS) >= len(DOCS) - 3
    k = n // 4 + 1  # resume in epoch 1
    first, old = global_batches(cfg, tok, k, dp_size=2, G=4)
    new = [build_loader(cfg, tok, global_batch_size=4, dp_rank=r, dp_size=4) for r in range(4)]
    for ld in new:
        ld.load_state_dict(old[1].state_dict())
    rest, _ = global_batches(cfg, tok, steps - k, 4, G=4, loaders=new)
    for a, b in zip(ref, first + rest):
        assert torch.equal(a, b)


def make_local_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(
        ["the cat sat on the mat", "a dog ate the bone", "hello world again"],
        trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]", "[EOS]"]),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    ).save_pretrained(path)
    return str(path)


def test_auto_tokenizer_from_local_path(tmp_path):
    path = make_local_tokenizer(tmp_path / "tok")
    tok = build_tokenizer(DataConfig(tokenizer=path))
    assert tok.vocab_size == 3 + len(
        {"the", "cat", "sat", "on", "mat", "a", "dog", "ate", "bone", "hello", "world", "again"}
    )
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("the dog sat on the mat")
    assert len(ids) == 6 and ids[0] == ids[4] and tok.decode(ids) == "the dog sat on the mat"
    assert tok.encode("the zebra") == [ids[0], 0]  # unknown word -> [UNK]
    assert tok.eos_id not in tok.encode("the [EOS] cat")  # text cannot inject control tokens

    docs = ["the cat sat on the mat", "a dog ate the bone", "hello world"] * 4
    (tmp_path / "d").mkdir()
    with open(tmp_path / "d" / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    cfg = hf_cfg(tmp_path, tmp_path / "d", tokenizer=path, seq_len=7)
    loader = build_loader(cfg, tok, global_batch_size=2, dp_rank=0, dp_size=1)
    got = torch.cat([loader.next_batch() for _ in range(3)]).flatten().numpy()
    np.testing.assert_array_equal(got, expected_stream(tok, docs)[:48])
    assert got[0] == tok.bos_id and got[7] == tok.eos_id  # [BOS] 6 words [EOS]


# --- errors --------------------------------------------------------------------------------


def one_line_error(fn, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        fn()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_errors(tmp_path):
    tok = ByteTokenizer()
    root = write_files(tmp_path / "j", "jsonl")

    def load(**kw):
        G = kw.pop("G", 4)
        return build_loader(hf_cfg(tmp_path, **kw), tok, global_batch_size=G, dp_rank=0, dp_size=1)

    one_line_error(
        lambda: load(path=tmp_path / "missing"), r"^data.path=.*missing.* does not exist"
    )
    one_line_error(
        lambda: load(path="./nope/train.jsonl"),
        r"does not exist \(relative paths start at .*\); give an existing file",
    )
    one_line_error(lambda: load(path=tmp_path / "*.parquet"), "matched no files")
    (tmp_path / "empty").mkdir()
    one_line_error(lambda: load(path=tmp_path / "empty"), r"is a directory without .*jsonl")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "y"}\n')
    one_line_error(lambda: load(path=tmp_path / "mixed"), "mixes file types")
    msg = one_line_error(
        lambda: load(path=root, text_field="content"), r"^data.text_field='content' is not a column"
    )
    assert "available: id, text" in msg
    msg = one_line_error(
        lambda: load(path=root, text_field="body", streaming=True),
        r"^data.text_field='body' is not a column",
    )
    assert "id, text" in msg
    one_line_error(
        lambda: load(path=root, G=4096),
        r"fewer than one global batch "
        r"\(train.global_batch_size=4096\)",
    )
    one_line_error(lambda: load(path=root, G=4096, streaming=True), "fewer than one global batch")
    one_line_error(
        lambda: build_loader(
            tiny_embedded(max_bytes=200), tok, global_batch_size=8, dp_rank=0, dp_size=1
        ),
        "raise data.max_bytes",
    )
    one_line_error(
        lambda: build_loader(tiny_embedded(), tok, global_batch_size=6, dp_rank=0, dp_size=4),
        r"global_batch_size=6 must be a positive "
        "multiple of the data-parallel size 4",
    )
    (tmp_path / "notok").mkdir()
    one_line_error(
        lambda: build_tokenizer(DataConfig(tokenizer=str(tmp_path / "notok"))),
        r"^data.tokenizer=.*notok.* cannot be loaded",
    )
    one_line_error(
        lambda: build_tokenizer(DataConfig(tokenizer=str(tmp_path / "absent"))),
        r"^data.tokenizer=.*absent.* is not a directory",
    )


def test_tokenized_cache_follows_file_content_and_tokenizer(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    cfg = hf_cfg(tmp_path, root, seq_len=7)
    byte = ByteTokenizer()

    def first_row(tok, docs=None):
        if docs is not None:
            with open(root / "a.jsonl", "w") as f:
                f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        return build_loader(cfg, tok, global_batch_size=1, dp_rank=0, dp_size=1).next_batch()[0]

    a = first_row(byte, ["the cat sat on the mat"] * 3)
    b = first_row(byte, ["a dog ate the bone now"] * 3)  # same file name, new content
    assert byte.decode(a) == "the cat" and byte.decode(b) == "a dog a"
    words = build_tokenizer(DataConfig(tokenizer=make_local_tokenizer(tmp_path / "tok")))
    c = first_row(words)  # same files, other tokenizer
    np.testing.assert_array_equal(c.numpy(), expected_stream(words, ["a dog ate the bone now"])[:8])


def _save_loader_with_dcp(rank, world_size, ckpt_dir):
    import torch.distributed.checkpoint as dcp

    loader = build_loader(
        tiny_embedded(), ByteTokenizer(), global_batch_size=8, dp_rank=rank, dp_size=world_size
    )
    for _ in range(50):  # into epoch 1
        loader.next_batch()
    dcp.save({"data": loader}, checkpoint_id=ckpt_dir)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loader_state_through_dcp_from_2_ranks_to_1(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tests.distributed import run_distributed

    run_distributed(_save_loader_with_dcp, 2, str(tmp_path / "ckpt"))
    tok, cfg = ByteTokenizer(), tiny_embedded()
    resumed = build_loader(cfg, tok, global_batch_size=8, dp_rank=0, dp_size=1)
    dcp.load({"data": resumed}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert resumed.samples_consumed == 400 and resumed.state_dict()["epoch"] == 1
    ref, _ = global_batches(cfg, tok, 53, dp_size=1)
    assert all(
        torch.equal(a, b) for a, b in zip(ref[50:], [resumed.next_batch() for _ in range(3)])
    )


def test_hub_dataset_that_cannot_be_loaded(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    # Offline mode fails at once instead of retrying a network that is not there.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    one_line_error(
        lambda: build_loader(
            hf_cfg(tmp_path, "someorg/no-such-dataset"),
            ByteTokenizer(),
            global_batch_size=4,
            dp_rank=0,
            dp_size=1,
        ),
        r"^data.path='someorg/no-such-dataset' is not a local path and could not "
        r"be loaded from the hub \(.*\); check the name",
    )
