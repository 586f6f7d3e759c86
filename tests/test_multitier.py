"""tests/harness/multitier.py: rows from each harness's output, the table and the exit status."""

from __future__ import annotations

import json

from tests.harness import multitier as mt

PARTS = ["tests", "parity", "kill9"]


def _rows():
    return [
        mt.row("tests", "test_a", "passed"),
        mt.row("parity", "4gpu fsdp bf16", "passed", "ok"),
        mt.row("kill9", "resume", "passed"),
    ]


def test_all_passed_exits_0():
    rows, counts, status = mt.summarize(_rows(), PARTS)
    assert status == 0 and counts == {"passed": 3, "failed": 0, "not run": 0, "refused": 0}
    text = mt.format_table(rows, counts)
    assert text.splitlines()[-1] == "multitier: 3 passed, 0 failed, 0 not run, 0 refused"


def test_a_failed_row_fails_and_shows_as_failed():
    rows, counts, status = mt.summarize(
        [*_rows(), mt.row("parity", "tp bf16", "failed", "x")], PARTS
    )
    assert status == 1 and counts["failed"] == 1
    assert "| parity | tp bf16 | FAILED | x |" in mt.format_table(rows, counts)


def test_not_run_counts_and_fails_unless_allowed():
    extra = mt.row("parity", "4gpu", "not run", "needs 4 GPUs, this machine has 2")
    _, counts, status = mt.summarize([*_rows(), extra], PARTS)
    assert counts["not run"] == 1 and counts["passed"] == 3 and status == 1
    assert mt.summarize([*_rows(), extra], PARTS, allow_not_run=True)[2] == 0


def test_a_part_without_rows_is_not_run():
    rows, counts, status = mt.summarize(_rows()[:2], PARTS)
    assert status == 1 and counts["not run"] == 1
    assert [r for r in rows if r["part"] == "kill9"][0]["result"] == "not run"
    # Rows come in the order of --parts.
    assert [r["part"] for r in rows] == PARTS


def test_refused_is_neither_passed_nor_failed():
    refused = mt.row("matrix", "fsdp_tp fp8_cs +q sync", "refused", "does not combine")
    _, counts, status = mt.summarize([*_rows(), refused], [*PARTS, "matrix"])
    assert status == 0 and counts["refused"] == 1 and counts["passed"] == 3


def test_job_rows_timeout_and_crash():
    ok = [mt.row("matrix", "a", "passed")]
    timed = mt.job_rows(ok, "matrix", "matrix tp", 124, 420)
    assert timed[-1]["result"] == "failed" and timed[-1]["detail"].startswith("timeout after 420 s")
    assert mt.job_rows(ok, "matrix", "j", 137, None)[-1]["detail"].startswith("timeout")
    crashed = mt.job_rows(ok, "matrix", "j", 1, None)
    assert crashed[-1] == mt.row("matrix", "j", "failed", "exit status 1")
    # A failing row already explains a non-zero status; no rows at all is a failure.
    failing = [mt.row("matrix", "a", "failed", "e")]
    assert mt.job_rows(failing, "matrix", "j", 1, None) == failing
    assert mt.job_rows([], "matrix", "j", 0, None)[0]["result"] == "failed"
    assert mt.job_rows(ok, "matrix", "j", 0, None) == ok


def test_parity_matrix_junit_rows():
    parity = {
        "curves": [
            {"layout": "tp+docs", "degrees": "1x1x2", "recipe": "bf16", "ok": True,
             "step1_rel": 1e-3, "max_rel": 2e-3},
            {"layout": "hsdp_tp", "skipped": "needs 4"},
            {"layout": "tp", "degrees": "1x1x2", "recipe": "fp8_cs", "ok": False, "error": "boom"},
        ],
        "fp8_allgather": [{"layout": "fsdp", "recipe": "fp8_cs", "weight": "w", "ok": True}],
    }  # fmt: skip
    got = [r["result"] for r in mt.parity_rows(parity, "parity", "2gpu")]
    assert got == ["passed", "not run", "failed", "passed"]
    matrix = [
        {"layout": "tp+cp2", "recipe": "bf16", "quantized_init": False, "mode": "sync",
         "resumed": True, "bitwise": True, "steps": 3, "max_abs": 0.0},
        {"layout": "tp", "recipe": "fp8_cs", "quantized_init": True, "mode": "async",
         "resumed": True, "bitwise": False, "steps": 3, "max_abs": 1e-3},
        {"layout": "fsdp_tp", "recipe": "fp8_cs", "quantized_init": True, "mode": "sync",
         "refused": "no"},
        {"layout": "ddp", "recipe": "bf16", "quantized_init": False, "mode": "sync", "error": "E"},
    ]  # fmt: skip
    got = [r["result"] for r in mt.matrix_rows(matrix, "matrix")]
    assert got == ["passed", "failed", "refused", "failed"]
    xml = (
        '<testsuites><testsuite><testcase classname="tests.gpu.test_cp_gpu" name="a" time="3"/>'
        '<testcase classname="x.y" name="b"><failure message="assert 1 == 2">tb</failure></testcase>'
        '<testcase classname="x.y" name="c"><skipped message="needs TE"/></testcase>'
        "</testsuite></testsuites>"
    )
    rows = mt.junit_rows(xml, "tests")
    assert [r["result"] for r in rows] == ["passed", "failed", "not run"]
    assert rows[0]["case"] == "test_cp_gpu::a" and rows[1]["detail"] == "assert 1 == 2"


def test_cli_table_reads_files_and_writes_markdown(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MULTITIER_ALLOW_NOT_RUN", raising=False)
    f = tmp_path / "rows_tests.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _rows()) + '{"cut')
    md = tmp_path / "t.md"
    assert mt.main(["table", "--parts", *PARTS, "--md", str(md), str(f)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("multitier: 3 passed") and md.read_text()
    assert mt.main(["notrun", "--part", "x", "--case", "c", "--reason", "r", "--out", str(f)]) == 0
    assert mt.main(["table", "--parts", *PARTS, "x", str(f)]) == 1
    monkeypatch.setenv("MULTITIER_ALLOW_NOT_RUN", "1")
    assert mt.main(["table", "--parts", *PARTS, "x", str(f)]) == 0
