"""tools/trace_summary.py against a hand-built trace whose figures are known."""

import json

import pytest

from tools import trace_summary as ts


def _k(name, ts_us, dur, stream, corr):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts_us,
        "dur": dur,
        "args": {"stream": stream, "correlation": corr},
    }


def _trace():
    # Host thread 1: an operator "outer" (0-100 us) around "aten::copy_" (10-20 us) that
    # launches kernel 1; a launch at 50 us inside "outer" only (kernel 2).
    cpu = [
        {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 10, "dur": 10, "tid": 1},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 12,
            "dur": 2,
            "tid": 1,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 50,
            "dur": 2,
            "tid": 1,
            "args": {"correlation": 2},
        },
    ]
    # Compute stream 7: a GEMM 1000-3000 us, an attention kernel 3500-4500, a copy 5000-5500,
    # another GEMM 5500-6000. Stream 20: NCCL 2000-4000 (overlaps 1000 us of GEMM and 500 us
    # of attention: 1500 us of compute beside NCCL). Window 1000-6000 us = 5 ms; compute busy
    # 2000 + 1000 + 500 + 500 = 4 ms, idle 1 ms.
    kernels = [
        _k("nvjet_sm90_tst_256x128", 1000, 2000, 7, 2),
        _k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 3500, 1000, 7, 3),
        _k("void at::native::elementwise_kernel<copy_>", 5000, 500, 7, 1),
        _k("nvjet_sm90_tst_256x128", 5500, 500, 7, 4),
        _k("ncclDevKernel_AllGather_RING_LL", 2000, 2000, 20, 5),
    ]
    return {"traceEvents": cpu + kernels}


def test_figures_of_a_known_trace():
    s = ts.summarize(_trace(), steps=1)
    assert s["compute_stream"] == 7
    assert s["window_ms"] == pytest.approx(5.0)
    assert s["compute_busy_ms"] == pytest.approx(4.0)
    assert s["compute_idle_ms"] == pytest.approx(1.0)
    assert s["compute_with_nccl_ms"] == pytest.approx(1.5)
    assert s["kinds_compute_ms"] == pytest.approx({"gemm": 2.5, "attention": 1.0, "copy/cast": 0.5})
    assert s["kinds_all_ms"]["nccl"] == pytest.approx(2.0)
    assert s["streams"]["20"]["busy_ms"] == pytest.approx(2.0)
    # the all-gather's 2 ms, 1.5 of them beside the GEMM and the attention kernel
    assert s["nccl"] == {
        "AllGather": {"ms": pytest.approx(2.0), "beside_compute_ms": pytest.approx(1.5)}
    }
    top = {t["name"]: t for t in s["top"]}
    assert top["nvjet_sm90_tst_256x128"]["ms"] == pytest.approx(2.5)
    assert top["nvjet_sm90_tst_256x128"]["calls"] == 2
    # Kernel 2 (2 ms) and kernel 4 (0.5 ms, launch unknown) share the name: the main path wins.
    assert top["nvjet_sm90_tst_256x128"]["launched_by"] == "outer (80%; 1 other paths)"
    assert top["void at::native::elementwise_kernel<copy_>"]["launched_by"] == "outer < aten::copy_"


def test_per_step_figures_divide_by_steps():
    one = ts.summarize(_trace(), steps=1)
    two = ts.summarize(_trace(), steps=2)
    assert two["window_ms"] == pytest.approx(one["window_ms"] / 2)
    assert two["kinds_all_ms"]["gemm"] == pytest.approx(one["kinds_all_ms"]["gemm"] / 2)


def test_union_and_overlap_of_intervals():
    assert ts.union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)
    assert ts.overlap_ms([(0, 1000), (2000, 3000)], [(500, 2500)]) == pytest.approx(1.0)


def test_kinds():
    assert ts.kind_of("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "nccl"
    assert ts.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert ts.kind_of("void transformer_engine::dgated_act_kernel<16>") == "te elementwise"
    assert ts.kind_of("void multi_tensor_apply_kernel<TensorListMetadata<4>, adam>") == (
        "optimizer/foreach"
    )
    assert ts.kind_of("triton_red_fused_chunk_stats_0") == "compiled"
    assert ts.kind_of("something_else") == "other"


def test_cli_prints_a_table(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    out_json = tmp_path / "summary.json"
    assert ts.main([str(path), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "| gemm | 2.5 | 2.5 |" in printed
    assert json.loads(out_json.read_text())["compute_idle_ms"] == pytest.approx(1.0)


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no device kernels"):
        ts.summarize({"traceEvents": []})


def test_attention_kernels_by_part_and_precision():
    """Forward, the recompute of activation checkpointing (a forward kernel launched from
    autograd's backward) and backward, each 16-bit or fp8 by the kernel's name: how a profile
    shows that every ring step of context parallelism ran the FP8 kernel."""
    fwd_op = {"ph": "X", "cat": "cpu_op", "name": "FusedAttnFunc", "ts": 0, "dur": 10, "tid": 1}
    bwd_op = {
        "ph": "X",
        "cat": "cpu_op",
        "name": "autograd::engine::evaluate_function: CheckpointFunctionBackward",
        "ts": 100,
        "dur": 100,
        "tid": 2,
    }

    def launch(ts_us, corr, tid):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": ts_us,
            "dur": 1,
            "tid": tid,
            "args": {"correlation": corr},
        }

    fprop8 = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f8_knob_1"
    kernels = [
        _k(fprop8, 1000, 300, 7, 1),  # forward, ring step 1
        _k(fprop8, 1400, 300, 7, 2),  # forward, ring step 2
        _k(fprop8, 2000, 300, 7, 3),  # recompute
        _k("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f8_knob", 2400, 700, 7, 4),
        _k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 3200, 200, 7, 5),
    ]
    cpu = [fwd_op, bwd_op, launch(1, 1, 1), launch(2, 2, 1), launch(110, 3, 2)]
    cpu += [launch(120, 4, 2), launch(5, 5, 1)]
    s = ts.summarize({"traceEvents": cpu + kernels})
    assert s["attention"] == {
        "backward fp8": {"ms": pytest.approx(0.7), "calls": 1},
        "forward 16-bit": {"ms": pytest.approx(0.2), "calls": 1},
        "forward fp8": {"ms": pytest.approx(0.6), "calls": 2},
        "recompute fp8": {"ms": pytest.approx(0.3), "calls": 1},
    }
    assert "| recompute fp8 | 0.3 | 1 |" in ts.render(s)
