"""checkpoint/ with TransformerEngine on GPU: each TE fix of compat/te.py and checkpoint/te_state.py
that checkpoints rely on, with a check that fails when the fix is absent (by forcing TE's
unpatched path), and quantized-parameter save/resume.

    python -m pytest -m gpu tests/gpu/test_checkpoint_gpu.py -q -s

One GPU, one process with a 1-rank "cpu:gloo,cuda:nccl" group (FSDP2 on a 1-rank mesh still
runs its all-gather hooks, reset_sharded_param and DCP's DTensor paths). The resharding test
needs 2 GPUs and skips otherwise. Uses small TE modules directly (not model/te_llama.py) so
each test isolates one mechanism.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model import te_available
from steps import train_step
from tests.distributed import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs CUDA and TransformerEngine"),
]

DIM, ROWS = 128, 32


@pytest.fixture(scope="module")
def pg():
    owned = not dist.is_initialized()
    if owned:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
        )
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    import compat

    compat.apply_all()  # what train.py does before building a model
    yield
    if owned:
        dist.destroy_process_group()


def _mesh(*names: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (1,) * len(names), mesh_dim_names=names)


class _Loader:
    def __init__(self):
        self.i = 0

    def batch(self) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(1000 + self.i)
        self.i += 1
        return torch.randn(ROWS, DIM, device="cuda", generator=g)

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = int(sd["i"])


def _manager(tmp: Path, mode: str = "sync", resume: str = "auto"):
    from checkpoint import CheckpointManager
    from checkpoint.config import CheckpointConfig

    return CheckpointManager(
        CheckpointConfig(mode=mode, interval=0, resume=resume),
        tmp,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        log=lambda m: None,
    )


def _quantized_linear(recipe, seed: int):
    """TE's FSDP2 flow for quantized weights: build on meta, shard, then reset_parameters
    quantizes each local shard (building on CUDA first would let fully_shard's chunking
    dequantize 2-D-blockwise weights)."""
    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import fully_shard

    with te.quantized_model_init(enabled=True, recipe=recipe):
        lin = te.Linear(2 * DIM, 2 * DIM, bias=False, params_dtype=torch.bfloat16, device="meta")
    fully_shard(lin, mesh=_mesh("dp_shard"))
    torch.manual_seed(seed)
    lin.reset_parameters()
    assert type(lin.weight._local_tensor).__name__ != "Tensor"  # quantized
    return lin


def _forward_backward(lin, recipe) -> torch.Tensor:
    """First forward: FSDP2's lazy init runs reset_sharded_param on every parameter."""
    import transformer_engine.pytorch as te

    x = torch.randn(ROWS, 2 * DIM, device="cuda", dtype=torch.bfloat16)
    with te.autocast(enabled=True, recipe=recipe):
        y = lin(x)
    y.float().pow(2).mean().backward()
    return y.detach()


def _square_mean(model, inputs, labels) -> torch.Tensor:
    """A train_step loss_fn for the models here, which map vectors to vectors (no labels)."""
    return model(inputs).float().pow(2).mean()


def _sum(model, inputs, labels) -> torch.Tensor:
    """A train_step loss_fn: one step that gives every weight a gradient."""
    return model(inputs).sum()


def _dequantized_weight(lin) -> torch.Tensor:
    w = lin.weight
    w = w._local_tensor if hasattr(w, "_local_tensor") else w
    return w.dequantize().float() if hasattr(w, "dequantize") else w.float()


# -- 1. QuantizedTensor.untyped_storage (TE PR 2974) ------------------------------------------


def test_untyped_storage_fix_needed_for_fsdp2_load(pg, tmp_path, monkeypatch):
    """Float8BlockwiseQTensor (2-D blocks) views as a dequantized plain tensor, so once FSDP2
    holds real sharded data (after a first load, `_apply`, or lazy init), its post-load hook
    reset_sharded_param compares storages: without an empty untyped_storage on QuantizedTensor
    that dereferences an invalid one. Loading twice reproduces it."""
    from transformer_engine.common.recipe import Float8BlockScaling
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    import compat.te as compat_te
    from checkpoint.state import ModelState

    assert compat_te.quantized_tensor_has_storage_fix()  # TE 2.20.2 has PR 2974
    saved = _quantized_linear(Float8BlockScaling(), seed=0)
    ckpt = _manager(tmp_path)
    ckpt.save(1, {"model": ModelState(saved)})
    ckpt.finish(1, {}, save=False)

    manager = _manager(tmp_path)
    monkeypatch.delattr(QuantizedTensor, "untyped_storage")  # TE without PR 2974
    broken = _quantized_linear(Float8BlockScaling(), seed=1)
    assert manager.resume({"model": ModelState(broken)}) == 1  # sharded data was meta
    with pytest.raises(RuntimeError, match="storage|data pointer"):
        manager.resume({"model": ModelState(broken)})

    assert compat_te.ensure_quantized_tensor_storage() is True  # detected missing: patched
    fixed = _quantized_linear(Float8BlockScaling(), seed=1)
    assert not torch.equal(_dequantized_weight(fixed), _dequantized_weight(saved))
    for _ in range(2):
        assert _manager(tmp_path).resume({"model": ModelState(fixed)}) == 1
    assert torch.equal(_dequantized_weight(fixed), _dequantized_weight(saved))


# -- 2. quantized parameters: save without dequantizing, sync and async ------------------------


@pytest.mark.parametrize("recipe_name", ["fp8_cs", "fp8_block"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_quantized_params_roundtrip(pg, tmp_path, recipe_name, mode):
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import Float8BlockScaling, Float8CurrentScaling
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    from checkpoint.state import ModelState

    # DCP stages a quantized tensor to CPU without dequantizing it (TE PR 2974).
    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cuda"))
    assert isinstance(q(torch.ones(16, 16, device="cuda")).cpu(), QuantizedTensor)
    recipe = Float8CurrentScaling() if recipe_name == "fp8_cs" else Float8BlockScaling()
    saved = _quantized_linear(recipe, seed=0)
    ckpt = _manager(tmp_path, mode=mode)
    ckpt.save(1, {"model": ModelState(saved)})
    ckpt.finish(1, {}, save=False)
    loaded = _quantized_linear(recipe, seed=1)
    assert _manager(tmp_path).resume({"model": ModelState(loaded)}) == 1
    local = loaded.weight._local_tensor
    assert type(local).__name__ != "Tensor"  # still quantized after the load
    assert torch.equal(_dequantized_weight(loaded), _dequantized_weight(saved))
    # fp8_block on this 1-rank FSDP2 mesh runs through compat/fsdp2.py's one-rank fix (applied
    # by the pg fixture): torch alone would hand TE only the data, not the block scales.
    torch.manual_seed(3)
    y_loaded = _forward_backward(loaded, recipe)
    torch.manual_seed(3)
    assert torch.equal(y_loaded, _forward_backward(saved, recipe))


# -- 3. DelayedScaling amax history and scales (TE issue 1860) ----------------------------------


def _delayed_setup(seed: int, with_te_state: bool):
    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import fully_shard
    from transformer_engine.common.recipe import DelayedScaling

    from checkpoint import TrainState, training_state

    torch.manual_seed(seed)
    recipe = DelayedScaling(amax_history_len=8)
    model = torch.nn.Sequential(te.Linear(DIM, DIM, bias=False), te.Linear(DIM, DIM, bias=False))
    fully_shard(model, mesh=_mesh("dp_shard"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader, train_state = _Loader(), TrainState()
    state = training_state(
        model, opt, sched, loader, train_state, te_recipe=recipe if with_te_state else None
    )

    def step(i: int) -> float:
        x = loader.batch()
        loss, _ = train_step(
            model,
            opt,
            x,
            x,
            scheduler=sched,
            autocast=te.autocast(enabled=True, recipe=recipe),
            loss_fn=_square_mean,
        )
        train_state.step = i
        return loss.item()

    return model, state, step


def _meta_tensors(model) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}.{a}": getattr(m.fp8_meta[k], a).clone()
        for i, m in enumerate(model)
        for k in ("scaling_fwd", "scaling_bwd")
        for a in ("scale", "amax_history")
    }


def test_delayed_scaling_state_resumes_exactly(pg, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, state, step = _delayed_setup(0, with_te_state=True)
    assert "te_scaling" in state
    for i in range(1, 4):
        step(i)
    ckpt = _manager(tmp_path)
    ckpt.save(3, state)
    ckpt.finish(3, state, save=False)
    meta = _meta_tensors(model)
    assert any(v.abs().sum() > 0 for k, v in meta.items() if "amax" in k)
    reference = [step(i) for i in range(4, 7)]

    model2, state2, step2 = _delayed_setup(1, with_te_state=True)
    assert _manager(tmp_path).resume(state2) == 3
    got = _meta_tensors(model2)
    assert all(torch.equal(got[k], meta[k]) for k in meta)
    assert [step2(i) for i in range(4, 7)] == reference

    # Without our state: amax histories restart from zero and the losses differ.
    model3, state3, step3 = _delayed_setup(1, with_te_state=False)
    assert _manager(tmp_path).resume(state3) == 3
    assert [step3(i) for i in range(4, 7)] != reference

    # And TE's own _extra_state does not load through DCP into a fresh FSDP2 model.
    dcp.save({"m": get_model_state_dict(model)}, checkpoint_id=str(tmp_path / "extra"))
    model4, _, _ = _delayed_setup(2, with_te_state=False)
    fresh = {"m": get_model_state_dict(model4)}
    with pytest.raises((Exception, CheckpointException)):  # noqa: B017
        dcp.load(fresh, checkpoint_id=str(tmp_path / "extra"))


# -- 4. FusedAdam DTensor states (TE PR 2795) ----------------------------------------------------


def test_fused_adam_states_are_dtensors_and_legacy_ones_get_wrapped(pg, monkeypatch):
    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformer_engine.pytorch.optimizers import FusedAdam

    from checkpoint.state import OptimizerState

    model = te.Linear(DIM, DIM, bias=False, device="cuda")
    fully_shard(model, mesh=_mesh("dp_shard"))
    opt = FusedAdam(model.parameters(), lr=1e-3)
    x = torch.randn(ROWS, DIM, device="cuda")
    train_step(model, opt, x, x, loss_fn=_sum)
    part = OptimizerState(model, opt)
    sd = part.state_dict()
    assert part._wrapped == set()  # upstream fix present: nothing to do
    assert isinstance(sd["state.weight.exp_avg"], DTensor)

    original = FusedAdam.state_dict

    def legacy_state_dict(self):  # FusedAdam before PR 2795
        out = original(self)
        for st in out["state"].values():
            for k, v in st.items():
                if isinstance(v, DTensor):
                    st[k] = v.to_local()
        return out

    monkeypatch.setattr(FusedAdam, "state_dict", legacy_state_dict)
    sd = part.state_dict()
    assert {"state.weight.exp_avg", "state.weight.exp_avg_sq"} <= part._wrapped
    assert isinstance(sd["state.weight.exp_avg"], DTensor)


# -- 5. FusedAdam resharding across GPU counts: 2 -> 1 --------------------------------------


def _reshard_worker(rank, world_size, tmp, phase):
    import faulthandler
    import threading

    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformer_engine.pytorch.optimizers import FusedAdam

    from checkpoint.state import ModelState, OptimizerState

    faulthandler.dump_traceback_later(45, exit=False)  # a hang shows every rank's stacks
    watchdog = threading.Timer(60, os._exit, args=(3,))  # then fails instead of hanging
    watchdog.daemon = True
    watchdog.start()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    print(f"worker {rank}/{world_size} {phase} start", flush=True)
    torch.cuda.set_device(rank)
    # A file store, not a TCP port: a port picked free can be taken before the store binds it
    # (seen once: EADDRINUSE while other jobs shared the host).
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        init_method=f"file://{tmp}/store-{phase}",
        rank=rank,
        world_size=world_size,
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(0)
        model = te.Linear(2 * DIM, DIM, bias=False, device="cuda")
        fully_shard(
            model, mesh=init_device_mesh("cuda", (world_size,), mesh_dim_names=("dp_shard",))
        )
        opt = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
        x = torch.randn(ROWS, 2 * DIM, device="cuda")
        train_step(model, opt, x, x, loss_fn=_sum)
        state = {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}
        ckpt = _manager(Path(tmp), resume="auto" if phase == "load" else "none")

        def full():
            return {
                k: v.full_tensor().cpu()
                for k, v in state["optimizer"].state_dict().items()
                if isinstance(v, DTensor)
            }

        if phase == "save":
            ckpt.resume(state)
            ckpt.save(1, state)
            ckpt.finish(1, state, save=False)
            gathered = full()  # a collective: every rank
            if rank == 0:
                torch.save(gathered, Path(tmp) / "full.pt")
        else:
            assert ckpt.resume(state) == 1
            want, got = torch.load(Path(tmp) / "full.pt"), full()
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    except BaseException:
        import traceback

        traceback.print_exc()  # now: destroy_process_group below can block while a peer waits
        sys.stdout.flush()
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fused_adam_reshards_2_to_1_gpus(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_reshard_worker, args=(2, str(tmp_path), "save"), nprocs=2)
    mp.spawn(_reshard_worker, args=(1, str(tmp_path), "load"), nprocs=1)


# -- 6. optim.moment_dtype=bf16: FusedAdam's moments in bf16, resumed exactly ---------------------


def _moments_setup(seed: int, moment_dtype: str):
    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import fully_shard

    from checkpoint import TrainState, training_state
    from optim import OptimConfig, build_optimizer

    torch.manual_seed(seed)
    # With biases: build_optimizer's second group (1-D parameters) must not be empty, as in the
    # model (its norms); DCP's optimizer loading cannot map an empty group.
    model = torch.nn.Sequential(te.Linear(DIM, DIM), te.Linear(DIM, DIM))
    fully_shard(model, mesh=_mesh("dp_shard"))
    cfg = OptimConfig(lr=1e-2, weight_decay=0.0, moment_dtype=moment_dtype)
    opt = build_optimizer(model, cfg, "te")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader, train_state = _Loader(), TrainState()
    state = training_state(model, opt, sched, loader, train_state)

    def step(i: int) -> float:
        x = loader.batch()
        loss, _ = train_step(model, opt, x, x, scheduler=sched, loss_fn=_square_mean)
        train_state.step = i
        return loss.item()

    return model, opt, state, step


def _local_weights(model) -> list[torch.Tensor]:
    return [p._local_tensor.detach().clone() for p in model.parameters()]


def test_bf16_moments_are_bf16_resume_exactly_and_track_fp32(pg, tmp_path):
    model, opt, state, step = _moments_setup(0, "bf16")
    for i in range(1, 4):
        step(i)
    moments = [s[k]._local_tensor for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.dtype == torch.bfloat16 for m in moments)
    ckpt = _manager(tmp_path)
    ckpt.save(3, state)
    ckpt.finish(3, state, save=False)
    saved = [m.clone() for m in moments]
    losses = [step(i) for i in range(4, 8)]
    weights = _local_weights(model)

    # A fresh run resumed from step 3 gets the same bf16 moments back (saved as fp32, which
    # holds every bf16 value exactly) and continues bit for bit.
    model2, opt2, state2, step2 = _moments_setup(1, "bf16")
    assert _manager(tmp_path).resume(state2) == 3
    moments2 = [s[k]._local_tensor for s in opt2.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(moments2, saved))
    assert [step2(i) for i in range(4, 8)] == losses
    assert all(torch.equal(a, b) for a, b in zip(_local_weights(model2), weights))

    # Against fp32 moments from the same start: the same training to bf16 rounding, not
    # bit-identical (the moments really are rounded).
    model3, _, _, step3 = _moments_setup(0, "fp32")
    reference = [step3(i) for i in range(1, 8)]
    assert reference[3:] != losses
    assert reference[3:] == pytest.approx(losses, rel=2e-2)
    for got, want in zip(weights, _local_weights(model3)):
        assert (got.float() - want.float()).abs().max() < 2e-2 * want.float().abs().max()
