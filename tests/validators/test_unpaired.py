"""Unpaired preference data (prompt/completion/label, TRL's KTO format) under the `preference` kind:
a good file passes; a bad label, a blank completion or one label only fails, naming the source, rule and row."""

from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import pytest

from rlhf_pipeline.trainers.data import DatasetSpec, load_source
from rlhf_pipeline.validators import DatasetFormat, DataValidationError, validate_dataset
from tests.helpers import write_jsonl


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def unpaired_rows():
    """Thumbs up and down on "sort the digits" answers: 3 desirable, 2 undesirable."""
    return [
        {"prompt": "sort 312 -> ", "completion": "123", "label": True},
        {"prompt": "sort 21 -> ", "completion": "21", "label": False},
        {"prompt": "sort 931 -> ", "completion": "139", "label": True},
        {"prompt": "sort 991 -> ", "completion": "919", "label": False},
        {"prompt": "sort 54 -> ", "completion": "45", "label": True},
    ]


def load(tmp_path, rows) -> tuple[str, datasets.Dataset]:
    """As the data stage reads a user's file: JSONL through `datasets`."""
    path = write_jsonl(tmp_path / "feedback.jsonl", rows)
    return str(path), load_source(DatasetSpec(path=str(path)))


def expect_failure(tmp_path, rows, rule, row) -> str:
    source, dataset = load(tmp_path, rows)
    with pytest.raises(DataValidationError) as caught:
        validate_dataset("preference", dataset, source=source)
    message = str(caught.value)
    assert message.startswith(f"{source}: rule '{rule}' failed"), message
    assert re.search(rf"e\.g\. row {row} \(0-based\):", message), message
    failed = {result.rule: result for result in caught.value.report.rules if not result.success}
    assert list(failed) == [rule], message  # one reason, reported once
    assert failed[rule].examples[0]["row"] == row
    return message


def test_good_unpaired_file_passes(tmp_path):
    from rlhf_pipeline.trainers.models.tiny import build_tokenizer

    source, dataset = load(tmp_path, unpaired_rows())
    report = validate_dataset("preference", dataset, source=source, max_tokens=20, tokenizer=build_tokenizer())
    assert report.success, report.summary()
    assert report.format == DatasetFormat("preference", False, "explicit", ("prompt", "completion", "label"))
    assert report.format.describe() == "standard unpaired preference (prompt, completion, label)"
    rules = [result.rule for result in report.rules]
    assert {"consistent_types", "text_not_blank", "label_is_boolean", "both_labels_present", "fits_max_length"} <= set(
        rules
    )
    assert "chosen_differs_from_rejected" not in rules


def test_good_conversational_unpaired_rows_pass():
    rows = [
        {"prompt": [user(r["prompt"])], "completion": [assistant(r["completion"])], "label": r["label"]}
        for r in unpaired_rows()
    ]
    report = validate_dataset("preference", datasets.Dataset.from_list(rows), source="feedback.jsonl")
    assert report.success, report.summary()
    assert report.format.conversational and report.format.unpaired
    assert {"valid_roles", "has_assistant_turn", "prompt_ends_with_user_turn"} <= {
        result.rule for result in report.rules
    }


def test_a_number_is_not_a_label(tmp_path):
    rows = unpaired_rows()
    rows[3]["label"] = 0
    message = expect_failure(tmp_path, rows, "label_is_boolean", row=3)
    assert "for 1 of 5 rows" in message and "label is an int, expected true or false: 0" in message


def test_a_missing_label_is_not_false(tmp_path):
    rows = unpaired_rows()
    rows[1]["label"] = None
    message = expect_failure(tmp_path, rows, "label_is_boolean", row=1)
    assert "label is None, expected true or false" in message


def test_blank_completion(tmp_path):
    rows = unpaired_rows()
    rows[2]["completion"] = "  "
    message = expect_failure(tmp_path, rows, "text_not_blank", row=2)
    assert "completion is whitespace-only: '  '" in message


def test_only_desirable_labels(tmp_path):
    rows = [row for row in unpaired_rows() if row["label"]]
    message = expect_failure(tmp_path, rows, "both_labels_present", row=0)
    assert "for 3 of 3 rows" in message and "all 3 labels are True: no undesirable row (label False)" in message


def test_the_same_answer_labelled_both_ways(tmp_path):
    rows = unpaired_rows()
    rows.append({"prompt": "sort 312 -> ", "completion": "123", "label": False})
    message = expect_failure(tmp_path, rows, "no_conflicting_labels", row=0)
    assert "row 5 has the same prompt and completion '123' labelled False" in message


def test_fits_max_length_counts_prompt_and_completion(tmp_path):
    from rlhf_pipeline.trainers.models.tiny import build_tokenizer

    rows = unpaired_rows()
    rows[4]["completion"] = "4" * 40
    source, dataset = load(tmp_path, rows)
    with pytest.raises(DataValidationError) as caught:
        validate_dataset("preference", dataset, source=source, max_tokens=30, tokenizer=build_tokenizer())
    message = str(caught.value)
    assert message.startswith(
        f"{source}: rule 'fits_max_length' failed for 1 of 5 rows (prompt + completion must fit in 30 tokens)"
    ), message
    assert re.search(r"row 4 \(0-based\): prompt \+ completion is \d+ tokens > 30", message), message


def test_unpaired_rows_need_a_prompt():
    rows = [{"completion": r["completion"], "label": r["label"]} for r in unpaired_rows()]
    with pytest.raises(
        DataValidationError, match=r"rule 'format' failed: unpaired preference data .* missing \['prompt'\]"
    ):
        validate_dataset("preference", datasets.Dataset.from_list(rows), source="feedback.jsonl")
