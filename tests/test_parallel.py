"""ParallelDims: degree resolution, one-line validation errors, groups; TP placement table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from config import ConfigError, compose_config, validate_tp_split
from model.config import ModelConfig
from model.llama import Llama
from parallel import ParallelConfig, ParallelDims, parallelize
from parallel.tp import placement_for
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def layout(name: str) -> ParallelConfig:
    return compose_config([f"parallel={name}"]).parallel


def fails(pcfg: ParallelConfig, world: int, *fields: str, mcfg: ModelConfig | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        dims = ParallelDims(pcfg, world)
        if mcfg is not None:
            validate_tp_split(mcfg, dims.tp)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for f in fields:
        assert f in msg, f"{f!r} not named in: {msg}"
    return msg


@pytest.mark.parametrize(
    "name, world, expect",
    [
        ("fsdp", 1, (1, 1, 1)),
        ("fsdp", 8, (1, 8, 1)),
        ("ddp", 4, (4, 1, 1)),
        ("hsdp", 8, (2, 4, 1)),
        ("tp", 4, (1, 1, 4)),
        ("fsdp_tp", 8, (1, 4, 2)),
        ("hsdp_tp", 8, (2, 2, 2)),
    ],
)
def test_conf_layouts_resolve(name, world, expect):
    dims = ParallelDims(layout(name), world)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == expect
    assert dims.dp_size == expect[0] * expect[1]


def test_product_mismatch():
    msg = fails(ParallelConfig(name="fsdp_tp", dp_shard=2, tp=2), 8, "dp_shard=2", "tp=2", "8")
    assert "world size" in msg


def test_tp_3_on_4_ranks():
    # parallel=fsdp_tp parallel.tp=3: dp_shard cannot absorb the rest.
    fails(ParallelConfig(name="fsdp_tp", dp_shard=-1, tp=3), 4, "tp=3", "dp_shard=-1", "4")
    # parallel=tp parallel.tp=3 (nothing inferred): the product is wrong.
    fails(ParallelConfig(name="tp", dp_shard=1, tp=3), 4, "tp=3", "world size 4")


def test_heads_not_divisible_by_tp():
    dims = ParallelDims(ParallelConfig(name="tp", dp_shard=1, tp=-1), 8)
    fails(
        dims.cfg,
        8,
        "model.n_heads=4",
        "parallel.tp=8",
        mcfg=ModelConfig(n_heads=4, n_kv_heads=4, dim=128),
    )
    fails(dims.cfg, 8, "model.n_kv_heads=2", mcfg=ModelConfig(n_heads=8, n_kv_heads=2, dim=128))
    fails(dims.cfg, 8, "model.ffn_dim=12", mcfg=ModelConfig(n_heads=8, n_kv_heads=8, ffn_dim=12))
    fails(
        dims.cfg,
        8,
        "pad_vocab_multiple",
        mcfg=ModelConfig(n_heads=8, n_kv_heads=8, pad_vocab_multiple=4),
    )
    validate_tp_split(
        ModelConfig(), ParallelDims(ParallelConfig(name="tp", dp_shard=1, tp=2), 2).tp
    )


def test_sequence_parallel_needs_divisible_seq_len():
    dims = ParallelDims(ParallelConfig(name="tp", dp_shard=1, tp=-1, sequence_parallel=True), 4)
    with pytest.raises(ConfigError, match=r"data.seq_len=30 .*parallel.tp=4"):
        dims.validate_seq_len(30)
    dims.validate_seq_len(32)
    ParallelDims(
        ParallelConfig(name="tp", dp_shard=1, tp=-1, sequence_parallel=False), 4
    ).validate_seq_len(30)


def test_hsdp_needs_replicas():
    fails(
        ParallelConfig(name="hsdp", dp_replicate=1, dp_shard=-1),
        4,
        "parallel.dp_replicate=1",
        "hsdp",
    )
    fails(ParallelConfig(name="hsdp_tp", dp_replicate=1, dp_shard=-1, tp=2), 4, "dp_replicate")


@pytest.mark.parametrize(
    "kw, world, expect",
    [
        (dict(name="fsdp", cp=2), 8, (1, 4, 2, 1)),
        (dict(name="hsdp", dp_replicate=2, cp=2), 8, (2, 2, 2, 1)),
        (dict(name="tp", dp_shard=1, tp=2, cp=-1), 8, (1, 1, 4, 2)),
        (dict(name="fsdp_tp", cp=2, tp=2), 8, (1, 2, 2, 2)),
    ],
)
def test_cp_resolves_with_every_degree(kw, world, expect):
    dims = ParallelDims(ParallelConfig(**kw), world)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == expect
    assert dims.loss_size == dims.dp_size * dims.cp


def test_cp_errors_name_the_fields():
    fails(ParallelConfig(name="tp", dp_shard=1, tp=2, cp=3), 8, "parallel.cp=3", "world size 8")
    fails(ParallelConfig(cp=2, cp_comm_type="ring"), 2, "parallel.cp_comm_type='ring'", "p2p")
    dims = ParallelDims(ParallelConfig(name="fsdp_tp", cp=2, tp=2), 4)
    with pytest.raises(ConfigError, match=r"data.seq_len=6 is not divisible by 2 x parallel.cp"):
        dims.validate_seq_len(6)
    with pytest.raises(
        ConfigError, match=r"12 / parallel.cp=2 = 6 tokens per rank .*parallel.tp=4"
    ):
        ParallelDims(ParallelConfig(name="fsdp_tp", cp=2, tp=4), 8).validate_seq_len(12)
    dims.validate_seq_len(8)


def test_two_inferred_degrees():
    fails(ParallelConfig(name="tp", dp_shard=-1, tp=-1), 4, "parallel.dp_shard", "parallel.tp")


def test_bad_degree_dtype_and_name():
    fails(ParallelConfig(dp_shard=0), 2, "parallel.dp_shard=0")
    fails(ParallelConfig(param_dtype="bf8"), 1, "parallel.param_dtype")
    fails(ParallelConfig(name="zero3"), 1, "parallel.name")


def test_single_process_without_group_is_a_no_op():
    assert not dist.is_initialized()
    dims = ParallelDims(ParallelConfig(), 1)
    assert dims.build_mesh("cpu") is None and dims.mesh is None
    assert dims.dp_group is None and dims.tp_group is None and dims.weight_shard_group is None
    assert (dims.dp_rank, dims.tp_rank, dims.dp_size) == (0, 0, 1)
    model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64))
    assert parallelize(model, dims, dims.cfg, "torch", mixed_precision=False) is model
    assert not any(hasattr(p, "device_mesh") for p in model.parameters())


def test_placement_table():
    assert placement_for("layers.3.self_attention.layernorm_qkv.weight") == Shard(0)
    assert placement_for("layers.0.self_attention.layernorm_qkv.layer_norm_weight") == Replicate()
    assert placement_for("layers.0.self_attention.proj.weight") == Shard(1)
    assert placement_for("layers.0.layernorm_mlp.fc1_weight") == _StridedShard(0, split_factor=2)
    assert placement_for("layers.0.layernorm_mlp.fc2_weight") == Shard(1)
    assert placement_for("layers.0.layernorm_mlp.layer_norm_weight") == Replicate()
    assert placement_for("norm.weight") == Replicate()
    assert placement_for("embed.weight") == Shard(0) == placement_for("lm_head.weight")
    with pytest.raises(ValueError, match="bias"):
        placement_for("layers.0.layernorm_mlp.fc1_bias")


def _groups(rank, world, all_degrees):
    for degrees in all_degrees:
        _check_groups(rank, world, *degrees)


def _check_groups(rank, world, dp_replicate, dp_shard, tp, cp=1):
    dims = ParallelDims(
        ParallelConfig(name="fsdp_tp", dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp),
        world,
    )
    dims.build_mesh("cpu")
    assert dims.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert (dims.dp_rank, dims.cp_rank, dims.tp_rank) == (
        rank // (cp * tp),
        rank // tp % cp,
        rank % tp,
    )

    def members(group):
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, rank, group=group)
        return sorted(out)

    # tp ranks are neighbours; data-parallel peers share the tp index; the weight-sharding
    # group is one replica (dp_shard x tp), never spanning dp_replicate.
    assert members(dims.tp_group) == [rank // tp * tp + i for i in range(tp)]
    same_cp_tp = [i for i in range(world) if i % (cp * tp) == rank % (cp * tp)]
    assert members(dims.dp_group) == same_cp_tp
    assert members(dims.loss_group) == [i for i in range(world) if i % tp == rank % tp]
    assert members(dims.cp_group) == [
        rank // (cp * tp) * cp * tp + j * tp + rank % tp for j in range(cp)
    ]
    replica = rank // (dp_shard * cp * tp)
    assert members(dims.weight_shard_group) == list(
        range(replica * dp_shard * cp * tp, (replica + 1) * dp_shard * cp * tp)
    )
    # FSDP shards over dp_shard x cp of one replica (and replicates over dp_replicate).
    shard_dim = dims.fsdp_mesh.get_group(dims.fsdp_mesh.ndim - 1)
    assert members(shard_dim) == [
        i for i in range(world) if i // (dp_shard * cp * tp) == replica and i % tp == rank % tp
    ]
    # Loaders: cp and tp ranks of one data-parallel group read the same samples.
    ids = [None] * world
    dist.all_gather_object(ids, dims.dp_rank)
    assert sorted(set(ids)) == list(range(dims.dp_size))


@pytest.mark.slow
def test_mesh_groups():
    run_distributed(_groups, 4, [(2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 1, 2, 2), (2, 1, 1, 2)])
    run_distributed(_groups, 8, [(2, 1, 2, 2)])


# ---- DCP with fc1's two-block tp shards (checkpoint/planners.py) ------------------------------------


def _sharded_model(cfg, pcfg, world, seed, mixed_precision=False):
    """The reference model built as train.py builds it: on meta, parallelized over `world`
    gloo ranks, then materialized and initialized. Returns (model, dims)."""
    from model.init import init_weights

    dims = ParallelDims(pcfg, world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(cfg)
    parallelize(model, dims, pcfg, "torch", mixed_precision=mixed_precision)
    model.to_empty(device="cpu")
    model.reset_buffers()
    init_weights(model, cfg, seed=seed)
    return model, dims


def _dcp_model(world, kw, seed, steps):
    from model.init import init_weights
    from tests.test_parallel_matrix import batches, tiny_cfg, train

    cfg = tiny_cfg()
    if world > 1:
        model, dims = _sharded_model(cfg, ParallelConfig(**kw), world, seed)
    else:
        model = Llama(cfg)
        init_weights(model, cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if steps:  # one step creates the optimizer states that the checkpoint carries
        dp = (dims.dp_rank, dims.dp_size, dims.dp_group) if world > 1 else ()
        train(model, batches(cfg, steps), *dp, opt=opt)
    return model, opt


def _full(sd):
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _full(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def _dcp_save(rank, world, kw, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from checkpoint.planners import BlockSavePlanner

    model, opt = _dcp_model(world, kw, 5, 1)
    msd, osd = get_state_dict(model, opt)
    full = _full({"model": msd, "optim": osd})
    state = {"model": msd, "optim": osd}
    if world == 4:  # async_save stages CPU copies first; the planner must see those
        dcp.async_save(state, checkpoint_id=path, planner=BlockSavePlanner()).result()
    else:
        dcp.save(state, checkpoint_id=path, planner=BlockSavePlanner())
    if rank == 0:
        torch.save(full, f"{path}/expected.pt")


def _dcp_load(rank, world, kw, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from checkpoint.planners import BlockLoadPlanner

    model, opt = _dcp_model(world, kw, 6, 1)  # other weights, its own optimizer states
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path, planner=BlockLoadPlanner())
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = _full(dict(zip(("model", "optim"), get_state_dict(model, opt))))
    want = torch.load(f"{path}/expected.pt")
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


TP2 = {"name": "tp", "dp_shard": 1, "tp": -1}
FSDP2_TP2 = {"name": "fsdp_tp", "dp_shard": -1, "tp": 2}


@pytest.mark.slow
def test_dcp_fc1_reshards_across_tp(tmp_path):
    """fc1 (and its Adam states) saved under tp=2 loads under fsdp x tp and into one process,
    and back (saved with async_save): the checkpoint holds the global [gate; up] layout
    whatever the tp."""
    a, b = str(tmp_path / "tp2"), str(tmp_path / "fsdp_tp")
    run_distributed(_dcp_save, 2, TP2, a)
    run_distributed(_dcp_load, 4, FSDP2_TP2, a)
    run_distributed(_dcp_save, 4, FSDP2_TP2, b)
    run_distributed(_dcp_load, 2, TP2, b)
    # One process, no mesh: plain tensors read the global layout.
    import torch.distributed.checkpoint as dcp

    model, _ = _dcp_model(1, None, 6, 0)
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=a, no_dist=True)
    want = torch.load(f"{a}/expected.pt")
    for k, v in sd.items():
        assert torch.equal(v, want[f"model.{k}"]), k


def _dcp_save_plain(rank, world, kw, path):
    import torch.distributed.checkpoint as dcp

    model, _ = _dcp_model(world, kw, 5, 0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)


@pytest.mark.slow
def test_dcp_without_block_planner_refuses_fc1(tmp_path):
    """Why the planners exist: torch's default planner cannot describe fc1's two-block shard."""
    with pytest.raises(AssertionError, match="overlapping chunks"):
        run_distributed(_dcp_save_plain, 2, TP2, str(tmp_path / "plain"))


# ---- activation checkpointing (parallel/ac.py) ----------------------------------------------


@pytest.mark.parametrize(
    "mode,every", [("full", 1), ("mlp", 1), ("full", 2), ("mlp", 3), ("selective", 2)]
)
def test_activation_checkpointing_matches_no_checkpointing(mode, every):
    """Same loss and bitwise the same gradients with and without recomputation (one process,
    fp32); the checkpointed modules are the ones the mode and `every` name, and parameter
    names do not change."""
    from model.init import init_weights
    from parallel.ac import apply_activation_checkpointing

    cfg = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(ac: bool):
        model = Llama(cfg)
        init_weights(model, cfg, 3)
        names = []
        if ac:
            names = apply_activation_checkpointing(model, mode, every)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, names

    loss, grads, _ = loss_and_grads(False)
    ac_loss, ac_grads, names = loss_and_grads(True)
    suffix = "" if mode == "full" else ".layernorm_mlp"
    assert names == [f"layers.{i}{suffix}" for i in range(0, cfg.n_layers, every)]
    assert torch.equal(loss, ac_loss)
    assert ac_grads.keys() == grads.keys()
    for n in grads:
        assert torch.equal(ac_grads[n], grads[n]), n


def test_activation_checkpointing_saves_memory_and_bad_mode_is_one_line():
    """Fewer bytes saved for backward with recomputation (counted by saved-tensor hooks), and
    a wrong mode fails in the config check with one line."""
    from model.init import init_weights
    from parallel.ac import apply_activation_checkpointing

    cfg = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))

    def saved_bytes(mode):
        model = Llama(cfg)
        init_weights(model, cfg, 3)
        apply_activation_checkpointing(model, mode)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens[:, :-1]).sum().backward()
        return total[0]

    none, mlp, full = (saved_bytes(m) for m in ("none", "mlp", "full"))
    assert full < mlp < none, (none, mlp, full)
    pcfg = compose_config(["parallel.activation_checkpointing=true"]).parallel
    fails(pcfg, 1, "parallel.activation_checkpointing=", "not one of none, full, mlp")
    pcfg = compose_config(["parallel.activation_checkpointing_every=0"]).parallel
    fails(pcfg, 1, "parallel.activation_checkpointing_every=0 must be >= 1")


def test_context_parallel_refusals_are_one_line():
    """What the TE path of context parallelism does not take, refused before any work."""
    from parallel.cp import check_cp

    llama = ModelConfig(n_heads=32, n_kv_heads=8, dim=4096)
    check_cp(2, 1, "p2p", "te", llama, None)
    check_cp(4, 2, "a2a", "te", llama, None)  # 8 / 2 KV heads split over 4
    check_cp(8, 1, "a2a+p2p", "te", llama, 4)  # heads over groups of 4, a ring of 2 groups
    check_cp(2, 1, "a2a+p2p", "torch", llama, None)  # the reference model takes every type
    for args, fields in (
        ((2, 1, "a2a+p2p", "te", llama, None), ("parallel.cp_a2a_size", "a divisor of 2")),
        ((8, 1, "a2a+p2p", "te", llama, 8), ("parallel.cp_a2a_size", "between 2 and 4")),
        ((8, 1, "a2a+p2p", "te", llama, 3), ("parallel.cp_a2a_size", "a divisor of 8")),
        ((8, 4, "a2a+p2p", "te", llama, 4), ("model.n_kv_heads=8", "cp_a2a_size=4")),
        ((4, 1, "p2p", "te", llama, 2), ("parallel.cp_a2a_size=2", "a2a+p2p only")),
        ((4, 4, "a2a", "te", llama, None), ("model.n_kv_heads=8", "parallel.cp=4")),
    ):
        with pytest.raises(ConfigError) as e:
            check_cp(*args)
        assert "\n" not in str(e.value) and all(f in str(e.value) for f in fields), str(e.value)


def test_document_split_matches_the_thd_contract():
    """Per-document context-parallel split (TE's THD layout): every document padded to a
    multiple of 2 x cp and cut into 2 x cp chunks, rank r holding chunks r and 2cp-1-r of each
    document in document order; every real token exactly once; padding after each document's
    last token; the stream a multiple of cp x align; loss scales summing to cp. Checked
    against a direct construction document by document."""
    from parallel.cp import split_documents

    rng = np.random.default_rng(0)
    for cp, align, rows, seq in ((2, 2, 2, 64), (4, 2, 3, 64), (2, 128, 1, 256), (4, 8, 2, 32)):
        starts = rng.random((rows, seq)) < 0.08
        starts[:, 0] = True
        idx = np.arange(seq)
        positions = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
        split = split_documents(positions, cp, align)
        # The documents, in the row-major stream, and the reference layout built from them.
        flat = positions.reshape(-1)
        bounds = np.append(np.flatnonzero(flat == 0), flat.size)
        expect_src = [[] for _ in range(cp)]
        cu = [0]
        for a, b in zip(bounds[:-1], bounds[1:]):
            n = b - a
            p = -(-n // (2 * cp)) * (2 * cp)
            doc = [a + i if i < n else -1 for i in range(p)]
            c = p // (2 * cp)
            for r in range(cp):
                expect_src[r] += (
                    doc[r * c : (r + 1) * c] + doc[(2 * cp - 1 - r) * c : (2 * cp - r) * c]
                )
            cu.append(cu[-1] + p)
        tail = -cu[-1] % (cp * align)
        if tail:
            for r in range(cp):
                expect_src[r] += [-1] * (tail // cp)
            cu.append(cu[-1] + tail)
        assert split.cu_seqlens.tolist() == cu
        assert split.cu_seqlens.dtype == np.int32
        for r in range(cp):
            assert split.source[r].tolist() == expect_src[r], (cp, r)
            assert len(split.source[r]) % align == 0
            # stream_index locates the token in the padded stream; positions count from its
            # padded document's start.
            doc_of = np.searchsorted(split.cu_seqlens, split.stream_index[r], side="right") - 1
            assert (split.positions[r] == split.stream_index[r] - split.cu_seqlens[doc_of]).all()
            real = split.source[r] >= 0
            assert (split.positions[r][real] == flat[split.source[r][real]]).all()
        every = np.concatenate(split.source)
        assert sorted(every[every >= 0].tolist()) == list(range(flat.size))
        assert sorted(np.concatenate(split.stream_index).tolist()) == list(range(cu[-1]))
        assert split.max_len == max(np.diff(cu))


def test_document_sharding_whole_rows_equal_the_causal_split():
    """A micro batch whose documents are whole rows: the per-document split holds the same
    tokens as the causal row split (each row cut into 2 x cp chunks), nothing padded."""
    from data.documents import Documents
    from parallel.cp import DocumentSharding, chunk_index

    rows, seq, cp = 3, 32, 2
    tokens = torch.arange(rows * seq).view(rows, seq)
    docs = Documents.from_positions(torch.arange(seq).expand(rows, seq))
    for r in range(cp):
        x, y, shard = DocumentSharding(docs, cp, r, None, 2).shard(tokens, tokens + 1)
        expect = tokens[:, chunk_index(seq, cp, r)].reshape(1, -1)
        assert torch.equal(x, expect) and torch.equal(y, expect + 1)
        assert shard.loss_scale == 1.0 and shard.cu_seqlens.tolist() == [0, 32, 64, 96]


def test_context_parallel_split_is_load_balanced():
    """cp rank r holds chunks r and 2cp-1-r; the ranks' pieces cover every position once and
    each rank's share of causal attention work (the sum of its tokens' positions + 1) is equal."""
    from parallel.cp import chunk_index

    for cp in (2, 4):
        pieces = [chunk_index(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(pieces).tolist()) == list(range(32))
        assert pieces[0].tolist()[: 32 // (2 * cp)] == list(range(32 // (2 * cp)))
        work = {int((p + 1).sum()) for p in pieces}
        assert len(work) == 1, work


def _a2a_p2p(rank, world_size):
    """Mesh dp_shard=2 x cp=4 (tp=2 on 16 ranks would be the same rule): each cp group's ranks
    in cp order, split into a2a groups of 2 consecutive cp ranks and p2p rings across them."""
    from parallel.cp import a2a_p2p_groups

    mesh = torch.arange(world_size).view(1, 2, 4, 1)
    a2a, p2p = a2a_p2p_groups(mesh.movedim(2, -1).reshape(-1, 4), 2, rank)
    base, i = divmod(rank, 4)  # this rank's cp group starts at 4 x base; cp rank i
    assert dist.get_process_group_ranks(a2a) == [4 * base + (i // 2) * 2 + k for k in range(2)]
    assert dist.get_process_group_ranks(p2p) == [4 * base + j * 2 + i % 2 for j in range(2)]
    # TE numbers the rank a2a_size x p2p rank + a2a rank: its cp rank.
    assert 2 * dist.get_rank(p2p) + dist.get_rank(a2a) == i


def test_a2a_p2p_groups_follow_te_rank_numbering():
    run_distributed(_a2a_p2p, 8)


# ---- FSDP2 mixed precision leaves the RoPE angles in fp32 (parallel/fsdp.py) ----------------


def _rope_angles_reach_blocks_in_fp32(rank, world_size):
    from tests.test_parallel_matrix import tiny_cfg

    cfg = tiny_cfg()
    # The GPU policy (bf16 gathers); FSDP2 runs it on CPU too.
    model, _ = _sharded_model(cfg, ParallelConfig(), world_size, 1, mixed_precision=True)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    model(tokens)
    x, freqs = seen[0][:2]
    # The hidden states are bf16 (the embedding's gathered weight is); the angles are the
    # model's own fp32 table, not a bf16 copy (off by up to position / 512 radians).
    assert x.dtype == torch.bfloat16
    assert freqs.dtype == torch.float32 and torch.equal(freqs, model.freqs)


def test_mixed_precision_keeps_rope_angles_fp32():
    run_distributed(_rope_angles_reach_blocks_in_fp32, 2)


# ---- parallel.keep_gathered_blocks: which blocks stay gathered between forward and backward --


def _gathered_blocks(indexed_blocks) -> list[int]:
    """The indices of the (index, block) pairs whose weights are gathered: a resharded block
    holds its DTensor shards, a kept one the gathered (plain) weights."""
    from torch.distributed.tensor import DTensor

    return [i for i, b in indexed_blocks if not any(isinstance(p, DTensor) for p in b.parameters())]


def _kept_blocks_and_grads(rank, world_size, overrides: dict):
    from tests.test_parallel_matrix import tiny_cfg

    cfg = dataclasses.replace(tiny_cfg(), n_layers=4)
    model, _ = _sharded_model(cfg, ParallelConfig(**overrides), world_size, 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, tokens)
    kept = _gathered_blocks(enumerate(model.layers))  # between forward and backward
    loss.backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return kept, grads


def _keep_gathered_blocks(rank, world_size):
    base_kept, base_grads = _kept_blocks_and_grads(rank, world_size, {})
    kept2, grads2 = _kept_blocks_and_grads(rank, world_size, {"keep_gathered_blocks": 2})
    all_kept, grads_all = _kept_blocks_and_grads(rank, world_size, {"reshard_after_forward": False})
    assert base_kept == [3]  # only the last of the 4 blocks, as always
    assert kept2 == [2, 3]
    assert all_kept == [0, 1, 2, 3]
    # Where the weights are gathered changes no gradient.
    for a, b, c in zip(base_grads, grads2, grads_all):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_keep_gathered_blocks_keeps_the_last_n_and_changes_no_gradient():
    run_distributed(_keep_gathered_blocks, 2)


def _step_holding_gathered(rank, world_size, overrides: dict, hold: bool, reduce_each: bool):
    """One train_step of 3 micro batches. Returns, per micro batch, the blocks after the first
    that hold gathered weights when block 0's forward begins, which blocks hold them after the
    step, and the parameters after it."""
    from parallel.fsdp import gathered_units
    from steps import train_step
    from tests.test_parallel_matrix import tiny_cfg

    cfg = dataclasses.replace(tiny_cfg(), n_layers=4)
    pcfg = ParallelConfig(**overrides)
    model, _ = _sharded_model(cfg, pcfg, world_size, 1)
    later = list(enumerate(model.layers))[1:]
    seen = []
    model.layers[0].register_forward_pre_hook(lambda *_: seen.append(_gathered_blocks(later)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = torch.randint(0, cfg.vocab_size, (6, 16), generator=torch.Generator().manual_seed(rank))
    train_step(
        model,
        opt,
        rows,
        rows,
        grad_accum=3,
        reduce_each_micro_batch=reduce_each,
        hold_gathered=gathered_units(model, pcfg) if hold else (),
    )
    after = _gathered_blocks(enumerate(model.layers))
    return seen, after, [p.full_tensor() for p in model.parameters()]


def _holding_gathered(rank, world_size):
    for reduce_each in (True, False):
        seen, after, ref = _step_holding_gathered(rank, world_size, {}, False, reduce_each)
        assert seen == [[], [], []] and after == []
        seen, after, last = _step_holding_gathered(rank, world_size, {}, True, reduce_each)
        assert seen == [[], [3], [3]] and after == []  # the last block: one all-gather a step
        keep = {"reshard_after_forward": False}
        seen, after, every = _step_holding_gathered(rank, world_size, keep, True, reduce_each)
        assert seen == [[], [1, 2, 3], [1, 2, 3]] and after == []
        # Holding the gathered weights changes no update.
        for a, b, c in zip(ref, last, every):
            assert torch.equal(a, b) and torch.equal(a, c)


def test_kept_blocks_stay_gathered_through_the_micro_batches_and_change_no_update():
    run_distributed(_holding_gathered, 2)


def test_keep_gathered_blocks_below_zero_is_one_line():
    with pytest.raises(ConfigError, match=r"parallel.keep_gathered_blocks=-1 must be >= 0"):
        ParallelDims(ParallelConfig(keep_gathered_blocks=-1), 2)
