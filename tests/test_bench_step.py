"""tools/bench_step.py's case syntax: the documents field -> train.py's data overrides."""

from __future__ import annotations

import pytest

from tools.bench_step import parse_case


@pytest.mark.parametrize(
    "field, dist",
    [("fixed/8193", "fixed"), ("exp/2048", "exponential"), ("logn/16384", "lognormal"),
     ("rows/2048", "whole_rows")],
)  # fmt: skip
def test_document_lengths_of_a_case(field, dist):
    case = parse_case(f"llama3_8b:fsdp:bf16:selective:1:{field}@data.seq_len=32768")
    assert case["data"] == {
        "data": "synthetic",
        "data.document_mask": "true",
        "data.doc_len": field.partition("/")[2],
        "data.doc_len_dist": dist,
    }
    assert case["extra"] == ["data.seq_len=32768"]


def test_an_unknown_length_distribution_is_refused_in_one_line():
    with pytest.raises(SystemExit, match=r"--case .*: expected .*logn/N\|rows/N"):
        parse_case("llama3_1b:fsdp:bf16:none:4:normal/2048")
