"""Rows and table of the GPU suite's `multitier` stage (tests/gpu/suite.sh): every multi-GPU check.

    python -m tests.harness.multitier rows parity --part parity --rc 0 --out rows.jsonl p.json
    python -m tests.harness.multitier rows matrix --part matrix --rc 124 --out rows.jsonl m.jsonl
    python -m tests.harness.multitier notrun --part kill9 --case "2 GPUs" \\
        --reason "needs 2 GPUs, this machine has 1" --out rows.jsonl
    python -m tests.harness.multitier table --parts tests ac parity matrix reshard kill9 \\
        --md table.md rows/*.jsonl

(from the repository root). Every part of the stage leaves rows, one JSON object a line:
{"part", "case", "result", "detail"} with result one of

    passed    the check ran and held
    failed    it ran and did not hold, crashed, or its job timed out ("timeout after N s")
    not run   it could not run here (too few GPUs, a skipped test, a part that left no rows)
    refused   the config check refuses the combination up front: a documented limit of the
              recipe (docs/PRECISION.md), reported, neither passed nor failed

`rows KIND` turns a harness's own output into rows (parity: its --json; matrix and ac: their
--jsonl; junit: pytest's --junitxml) and adds a failed row when the job's exit status says
it failed without a failing row (a crash, a timeout: 124 / 137 from `timeout`). `table`
prints one Markdown table of every row, a part of --parts with no row counted as not run, and
the last line `multitier: P passed, F failed, N not run, R refused`; exit status 1 when any
row failed, or any is not run (unless MULTITIER_ALLOW_NOT_RUN=1), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from runlog import read_metrics  # a JSON line per row (a line cut by a killed job: skipped)

RESULTS = ("passed", "failed", "not run", "refused")
#: Exit statuses of `timeout` (124: the command timed out; 137: killed by its -k SIGKILL).
TIMEOUT_RC = (124, 137)


def row(part: str, case: str, result: str, detail: str = "") -> dict:
    if result not in RESULTS:
        raise ValueError(f"result {result!r} is not one of {RESULTS}")
    return {"part": part, "case": case, "result": result, "detail": detail}


def emit_row(rows: list[dict], row: dict, rank: int, jsonl: str | Path | None) -> None:
    """Keep a finished case's row; rank 0 prints it and appends it to `jsonl` at once (a
    later case that hangs or kills the job keeps the earlier rows)."""
    rows.append(row)
    if rank == 0:
        print(json.dumps(row), flush=True)
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")


def _ok(flag) -> str:
    return "passed" if flag else "failed"


def parity_rows(results: dict, part: str, label: str) -> list[dict]:
    """tests/harness/parity.py's --json: a row per curve and per all-gathered weight."""
    out = []
    for r in results.get("curves", []):
        case = f"{label} {r['layout']} {r.get('recipe', '')}".strip()
        if "skipped" in r:
            out.append(row(part, case, "not run", r["skipped"]))
        elif "error" in r:
            out.append(row(part, case, "failed", r["error"]))
        else:
            detail = f"{r['degrees']}: step-1 rel {r['step1_rel']:.2e}, max rel {r['max_rel']:.2e}"
            out.append(row(part, case, _ok(r.get("ok")), detail))
    for r in results.get("fp8_allgather", []):
        case = f"{label} fp8 all-gather {r['layout']} {r['recipe']} {r.get('weight', '')}".strip()
        detail = r.get("error") or f"equal={r.get('equal')} scale_equal={r.get('scale_equal')}"
        out.append(row(part, case, _ok(r.get("ok")), detail))
    return out


def matrix_rows(rows: list[dict], part: str) -> list[dict]:
    """tests/harness/matrix.py's --jsonl rows: resumed and bitwise, refused, or failed."""
    out = []
    for r in rows:
        case = f"{r['layout']} {r['recipe']}{' +q' if r.get('quantized_init') else ''} {r['mode']}"
        if "refused" in r:
            out.append(row(part, case, "refused", r["refused"]))
        elif "error" in r:
            out.append(row(part, case, "failed", r["error"]))
        else:
            ok = bool(r.get("resumed") and r.get("bitwise"))
            detail = (
                f"resumed={r.get('resumed')} bitwise={r.get('bitwise')} over {r.get('steps')} "
                f"steps, max abs {r.get('max_abs', float('nan')):.3g}"
            )
            out.append(row(part, case, _ok(ok), detail))
    return out


def ac_rows(rows: list[dict], part: str) -> list[dict]:
    """tests/harness/ac_layouts.py's --jsonl rows (`ok` per row)."""
    out = []
    for r in rows:
        case = r.get("case") or f"{r.get('layout')} {r.get('recipe')} {r.get('mode')}"
        detail = r.get("error") or r.get("got") or ""
        if not detail and "loss1" in r:
            detail = f"loss {r['loss1']:.4f} -> {r['loss2']:.4f}"
        out.append(row(part, case, _ok(r.get("ok")), detail))
    return out


def junit_rows(xml_text: str, part: str) -> list[dict]:
    """pytest's --junitxml: a row per test (failure or error: failed; skipped: not run)."""
    out = []
    for tc in ET.fromstring(xml_text).iter("testcase"):
        case = f"{tc.get('classname', '').rsplit('.', 1)[-1]}::{tc.get('name')}"
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            first = (bad.get("message") or bad.tag).splitlines() or [bad.tag]
            out.append(row(part, case, "failed", first[0][:200]))
        elif tc.find("skipped") is not None:
            out.append(row(part, case, "not run", (tc.find("skipped").get("message") or "")[:200]))
        else:
            out.append(row(part, case, "passed", f"{float(tc.get('time', 0)):.0f} s"))
    return out


def job_rows(rows: list[dict], part: str, job: str, rc: int, timeout_s: float | None) -> list[dict]:
    """`rows` of one job, plus a failed row for the job itself when its exit status says it
    failed (or timed out) and no row shows it, or when it left no row at all."""
    failed = any(r["result"] == "failed" for r in rows)
    if rc in TIMEOUT_RC:
        limit = f" after {timeout_s:g} s" if timeout_s else ""
        return [*rows, row(part, job, "failed", f"timeout{limit} (exit status {rc})")]
    if rc != 0 and not failed:
        return [*rows, row(part, job, "failed", f"exit status {rc}")]
    if not rows:
        return [row(part, job, "failed", f"left no results (exit status {rc})")]
    return rows


def convert(kind: str, files: list[Path], part: str, label: str) -> list[dict]:
    rows: list[dict] = []
    for f in files:
        if not f.is_file():
            continue
        if kind == "parity":
            rows += parity_rows(json.loads(f.read_text()), part, label)
        elif kind == "matrix":
            rows += matrix_rows(read_metrics(f), part)
        elif kind == "ac":
            rows += ac_rows(read_metrics(f), part)
        elif kind == "junit":
            rows += junit_rows(f.read_text(), part)
        elif kind == "rows":  # already rows (reshard, kill9)
            rows += [r for r in read_metrics(f) if r.get("part") == part]
        else:
            raise ValueError(f"unknown kind {kind!r}")
    return rows


def summarize(rows: list[dict], parts: list[str], allow_not_run: bool = False):
    """(rows with a not-run row for every part of `parts` that has none, counts, exit status)."""
    rows = list(rows)
    seen = {r["part"] for r in rows}
    for p in parts:
        if p not in seen:
            rows.append(row(p, "(part)", "not run", "left no rows: the part did not run"))
    counts = {k: sum(r["result"] == k for r in rows) for k in RESULTS}
    bad = counts["failed"] > 0 or (counts["not run"] > 0 and not allow_not_run)
    order = {p: i for i, p in enumerate(parts)}
    rows.sort(key=lambda r: order.get(r["part"], len(order)))  # stable: a part's own order
    return rows, counts, 1 if bad else 0


def format_table(rows: list[dict], counts: dict) -> str:
    lines = ["| part | case | result | detail |", "|---|---|---|---|"]
    for r in rows:
        result = "FAILED" if r["result"] == "failed" else r["result"]
        detail = str(r.get("detail", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['part']} | {r['case']} | {result} | {detail} |")
    lines.append("")
    lines.append(
        f"multitier: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['not run']} not run, {counts['refused']} refused"
    )
    return "\n".join(lines)


def append(out: Path, rows: list[dict]) -> None:
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rows", help="a harness's output -> rows")
    r.add_argument("kind", choices=["parity", "matrix", "ac", "junit", "rows"])
    r.add_argument("files", nargs="*", type=Path)
    r.add_argument("--part", required=True)
    r.add_argument("--job", default=None, help="the job's case name (default: the files)")
    r.add_argument("--label", default="", help="prefix of parity cases (e.g. '4 GPUs')")
    r.add_argument("--rc", type=int, default=0, help="the job's exit status")
    r.add_argument("--timeout", type=float, default=None, help="the job's time limit, s")
    r.add_argument("--out", type=Path, required=True)
    n = sub.add_parser("notrun", help="one not-run row")
    n.add_argument("--part", required=True)
    n.add_argument("--case", required=True)
    n.add_argument("--reason", required=True)
    n.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table", help="the table of every row; exit status")
    t.add_argument("files", nargs="*", type=Path)
    t.add_argument("--parts", nargs="+", required=True)
    t.add_argument("--md", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.cmd == "rows":
        job = a.job or " ".join(f.name for f in a.files) or a.kind
        got = convert(a.kind, a.files, a.part, a.label)
        append(a.out, job_rows(got, a.part, job, a.rc, a.timeout))
        return 0
    if a.cmd == "notrun":
        print(f"{a.part}: {a.case}: not run: {a.reason}")
        append(a.out, [row(a.part, a.case, "not run", a.reason)])
        return 0
    rows = [x for f in a.files for x in read_metrics(f)]
    allow = os.environ.get("MULTITIER_ALLOW_NOT_RUN") == "1"
    rows, counts, status = summarize(rows, a.parts, allow)
    text = format_table(rows, counts)
    if a.md:
        a.md.write_text(text + "\n")
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
