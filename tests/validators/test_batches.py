"""Checks that read a dataset in record batches name the same rows as one pass over it: validate_dataset
(validators/validate.py), the leakage rule (validators/leakage.py) and the raw line checks (validators/files.py)."""

from __future__ import annotations

import datasets
import pytest

from rlhf_pipeline.validators import DataValidationError, check_files, validate_dataset
from rlhf_pipeline.validators import files as raw_files
from rlhf_pipeline.validators.leakage import Split, check_leakages

ROWS, BATCH = 3500, 1000  # four batches, the last one short


def pairs() -> list[dict]:
    rows = [
        {"prompt": f"Summarise ticket {i}: ", "chosen": f"Fixed {i}.", "rejected": f"Maybe {i}."} for i in range(ROWS)
    ]
    rows[1234]["rejected"] = rows[1234]["chosen"]  # second batch
    rows[2100]["chosen"] = "\u3000Fixed, after a wide space.\t"  # valid, but past Arrow's screen: Python checks it
    rows[2101]["prompt"] = None  # third batch: the wrong type, and no text to measure
    rows[ROWS - 1]["chosen"] = "  "  # the very last row
    return rows


def conversations() -> list[dict]:
    def chat(i: int, answer: str) -> list[dict]:
        return [{"role": "user", "content": f"sort {i}"}, {"role": "assistant", "content": answer}]

    rows = [{"chosen": chat(i, "sorted"), "rejected": chat(i, "unsorted")} for i in range(ROWS)]
    rows[1500]["chosen"] = rows[1500]["chosen"][:1]  # no assistant turn
    rows[ROWS - 1]["rejected"][0]["role"] = "human"
    return rows


def failures(rows: list[dict], batch_rows: int) -> dict:
    with pytest.raises(DataValidationError) as caught:
        validate_dataset("preference", datasets.Dataset.from_list(rows), source="big.jsonl", batch_rows=batch_rows)
    return caught.value.report.to_dict()


def failed_rows(report: dict) -> dict[str, tuple[int, list[int]]]:
    return {
        rule["rule"]: (rule["failed_count"], [e["row"] for e in rule["examples"]])
        for rule in report["rules"]
        if not rule["success"]
    }


def test_batches_name_the_dataset_rows_of_standard_pairs():
    batched = failures(pairs(), BATCH)
    assert failed_rows(batched) == {
        "consistent_types": (1, [2101]),
        "text_not_blank": (1, [ROWS - 1]),
        "chosen_differs_from_rejected": (1, [1234]),
    }
    assert failures(pairs(), ROWS) == batched  # one batch: the same report, word for word


def test_batches_name_the_dataset_rows_of_conversations():
    batched = failures(conversations(), BATCH)
    assert failed_rows(batched) == {
        "valid_roles": (1, [ROWS - 1]),
        "has_assistant_turn": (1, [1500]),
        "shared_prompt_turns": (1, [ROWS - 1]),
    }
    assert failures(conversations(), ROWS) == batched


def test_the_leakage_rule_quotes_the_first_training_row_across_batches():
    train = [{"prompt": f"sort {i} -> ", "completion": "x"} for i in range(2500)]
    train[1700]["prompt"] = train[2200]["prompt"] = "the   leaked prompt "  # the first of its two rows is quoted
    train[2300]["prompt"] = "café \u00a0order"  # not plain ASCII: normalised in Python
    held = [{"prompt": p} for p in ("fresh", "the leaked prompt", "café order", "sort 999 -> ")]
    training = Split("sft", "sft", "train.jsonl", datasets.Dataset.from_list(train))
    held_out = Split("prompts_eval", "prompt", "eval.jsonl", datasets.Dataset.from_list(held))
    (result,) = check_leakages([(held_out, [training])], batch_rows=BATCH)
    assert [(e["row"], e["value"].split(" is also ")[1]) for e in result.examples] == [
        (1, "row 1700 of sft (train.jsonl)"),
        (2, "row 2300 of sft (train.jsonl)"),
        (3, "row 999 of sft (train.jsonl)"),
    ]


def test_line_checks_name_the_file_lines_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(raw_files, "BLOCK_BYTES", 64)  # most lines straddle two blocks
    lines = [f'{{"prompt": "sort {i} -> ", "completion": "{i}"}}' for i in range(40)]
    lines[7] = '{"prompt": "sort'  # cut
    lines[20] = ""  # blank: not a row, but a line
    lines[33] = '["a list"]'
    path = tmp_path / "d.jsonl"
    # A bad byte on the last line, no newline
    path.write_bytes(("\n".join(lines[:-1]) + "\n").encode() + b'{"prompt": "\xff"}')
    (report,) = check_files("sft", [path])
    found = {rule.rule: [e["line"] for e in rule.examples] for rule in report.rules if not rule.success}
    assert found == {"utf8": [40], "json_lines": [8, 34]}
    assert report.num_rows == 40
