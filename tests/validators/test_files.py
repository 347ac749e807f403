"""Tests for validators/files.py: raw-file rules with 1-based lines, on one file or several."""

from __future__ import annotations

import json

from rlhf_pipeline.validators import DataValidationError, check_files
from rlhf_pipeline.validators.files import MAX_ROW_BYTES


def row(prompt: str) -> str:
    return json.dumps({"prompt": prompt, "completion": "1"}) + "\n"


def failed(report) -> dict[str, list[int]]:
    return {r.rule: [e["line"] for e in r.examples] for r in report.rules if not r.success}


def test_a_row_over_the_default_one_mib_limit_is_rejected_by_line(tmp_path):
    path = tmp_path / "huge.jsonl"
    path.write_text(row("sort 12 -> ") + row("x" * MAX_ROW_BYTES) + row("sort 21 -> "))
    (report,) = check_files("sft", [path])
    assert failed(report) == {"row_size": [2]}
    message = str(DataValidationError(report))
    assert message.startswith(f"{path}: rule 'row_size' failed for 1 of 3 lines") and "e.g. line 2: " in message


def test_every_file_of_a_list_gets_its_own_report(tmp_path):
    good = tmp_path / "a.jsonl"
    # A byte-order mark, blank lines and CRLF endings are fine: `datasets` reads them.
    good.write_bytes(b"\xef\xbb\xbf" + row("sort 1 -> ").strip().encode() + b"\r\n\n" + row("sort 2 -> ").encode())
    cut = tmp_path / "b.jsonl"
    cut.write_text(row("sort 1 -> ") + '{"prompt": "sort')
    csv = tmp_path / "c.csv"
    csv.write_text("prompt,completion\nsort 1 -> ,1\n")
    reports = check_files("sft", [good, cut, csv])
    assert [r.source for r in reports] == [str(good), str(cut), str(csv)]
    assert [failed(r) for r in reports] == [{}, {"json_lines": [2]}, {}]
    assert "truncated?" in reports[1].rules[2].examples[0]["value"]
