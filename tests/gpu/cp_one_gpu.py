"""TE's context-parallel attention on ONE GPU: `cp` processes share GPU 0 and talk through a
gloo process group (NCCL refuses two ranks on one device). The communication is slower than
NCCL's and nothing here is timed: what runs is TE's own context-parallel code (p2p ring,
all-gather, all-to-all, hierarchical a2a+p2p) on real kernels, fed by this recipe's split
(parallel/cp.py) and TE model (model/te_llama.py).

    torchrun --standalone --nproc_per_node=2 tests/gpu/cp_one_gpu.py --comm p2p --documents \
        --out /tmp/cp.json

gloo cannot send CUDA tensors point to point, so for the p2p ring (p2p, a2a+p2p) each step's
K/V messages are carried through host memory (`_host_p2p`, replacing TE's send/recv helper):
TE's ring, its per-step kernels and softmax corrections run unchanged, only the bytes' path
differs (and nothing overlaps: no timing here).

Every rank builds the same TE model twice from one seed, one with the cp group set, one
without, and an fp32 reference model (model/llama.py). One forward and backward of the same
batch (4 rows of 256 tokens: packed documents of 1-120 tokens with --documents, else causal
rows): the cp model on this rank's part (its loss scaled by its share, gradients averaged over
the ranks, as FSDP does), the others on the whole rows. Rank 0 writes the losses and the
relative gradient errors (||g - g_ref|| / ||g_ref|| over all parameters) as JSON; the test
(tests/gpu/test_cp_gpu.py) judges them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.documents import DocumentBoundaries  # noqa: E402
from model.init import init_weights  # noqa: E402
from model.llama import Llama  # noqa: E402
from parallel.cp import apply_te_cp, token_align  # noqa: E402
from steps import BatchLayout, micro_batch_loss, next_token_loss, split_micro_batches  # noqa: E402
from tests.gpu.test_documents_gpu import BOS, EOS, cfg, packed  # noqa: E402


class _Dims:
    """What apply_te_cp reads of parallel.dims.ParallelDims: the cp group and the mesh."""

    def __init__(self, cp: int):
        self.cp = cp
        self.cp_group = dist.group.WORLD
        self.mesh = type("Mesh", (), {"mesh": torch.arange(cp).view(1, 1, cp, 1)})()


class _Done:
    """A finished request: TE waits on it and goes on."""

    def wait(self):
        return True


def _host_p2p(rank, send_tensor, send_dst, recv_tensor, recv_src, cp_group, batch_p2p_comm):
    """TE's flash_attn_p2p_communicate through host memory: in TE's ring every rank of the
    group sends one equal-sized message to its next rank and receives one from its previous
    rank in the same call, so one all-gather of the messages (gloo takes CPU tensors) carries
    them; the receive is complete when this returns."""
    del rank, send_dst, batch_p2p_comm
    torch.cuda.synchronize()  # the kernels that produced the message, on whichever stream
    sent = send_tensor.cpu()
    every = [torch.empty_like(sent) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(every, sent, group=cp_group)
    recv_tensor.copy_(every[dist.get_group_rank(cp_group, recv_src)])
    torch.cuda.synchronize()
    return [_Done()]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _rel(a: dict, b: dict) -> float:
    num = sum(((a[n] - b[n]) ** 2).sum() for n in b)
    den = sum((b[n] ** 2).sum() for n in b)
    return float((num / den).sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comm", default="p2p")
    ap.add_argument("--a2a-size", type=int, default=None)
    ap.add_argument("--documents", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    from transformer_engine.pytorch.attention.dot_product_attention import context_parallel

    from model.te_llama import TELlama

    context_parallel.flash_attn_p2p_communicate = _host_p2p

    c = cfg()
    models = {}
    for name in ("cp", "one"):
        models[name] = TELlama(c, device="cuda")
        init_weights(models[name], c, 0)
    with torch.device("cuda"):
        models["fp32"] = Llama(c)
    init_weights(models["fp32"], c, 0)
    apply_te_cp(models["cp"], _Dims(cp), args.comm, args.a2a_size)

    rows, labels, docs = packed(0)
    if not args.documents:
        docs = None
    full = torch.cat([rows, labels[:, -1:]], dim=1)
    layout = BatchLayout(
        None if docs is None else DocumentBoundaries(BOS, EOS),
        cp=cp,
        cp_rank=rank,
        cp_group=dist.group.WORLD,
        align=token_align("te", 1),
    )
    inputs, targets, part = layout(full)
    ((x, y, d),) = split_micro_batches(inputs.cuda(), targets.cuda(), part, 1, torch.device("cuda"))
    bf16 = torch.autocast("cuda", dtype=torch.bfloat16)
    with bf16:
        loss_cp = micro_batch_loss(next_token_loss, models["cp"], x, y, d)
    loss_cp.backward()
    # The ranks' mean, as FSDP's reduce-scatter over dp_shard x cp averages the gradients.
    total = loss_cp.detach().float().cpu()
    dist.all_reduce(total)
    grads_cp = _grads(models["cp"])
    for g in grads_cp.values():
        host = g.cpu()
        dist.all_reduce(host)
        g.copy_(host / cp)

    on_gpu = None if docs is None else docs.to("cuda")
    with bf16:
        loss_one = next_token_loss(models["one"], rows.cuda(), labels.cuda(), on_gpu)
    loss_one.backward()
    loss_32 = next_token_loss(models["fp32"], rows.cuda(), labels.cuda(), on_gpu)
    loss_32.backward()
    g_one, g_32 = _grads(models["one"]), _grads(models["fp32"])
    if rank == 0:
        result = {
            "comm": args.comm,
            "cp": cp,
            "documents": args.documents,
            "tokens_per_rank": int(x.numel()),
            "loss_cp": float(total) / cp,
            "loss_cp1": loss_one.item(),
            "loss_fp32": loss_32.item(),
            "grad_rel_cp_vs_cp1": _rel(grads_cp, g_one),
            "grad_rel_cp_vs_fp32": _rel(grads_cp, g_32),
            "grad_rel_cp1_vs_fp32": _rel(g_one, g_32),
        }
        Path(args.out).write_text(json.dumps(result))
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(
        60 + 15 * int(os.environ.get("RANK", 0)), exit=True
    )  # a hang shows where, then ends the rank
    os.environ.setdefault("NVTE_TORCH_COMPILE", "0")
    main()
