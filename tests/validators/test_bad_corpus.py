"""The bad-input corpus (tests/data/bad/, listed in cases.yaml): the `data` stage rejects every
file with a message naming the file, the rule and the example rows, and publishes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rlhf_pipeline import validators
from rlhf_pipeline.tasks.data import validate_data
from rlhf_pipeline.tasks.store.artifacts import RunContext
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.data import DataConfig, DatasetSpec
from tests.helpers import write_data_dir

BAD = Path(__file__).resolve().parents[1] / "data" / "bad"
MANIFEST = BAD / "cases.yaml"
CASES = yaml.safe_load(MANIFEST.read_text())["cases"]
SLOT_KINDS = {
    "sft": "sft",
    "preference": "preference",
    "preference_eval": "preference",
    "prompts": "prompt",
    "prompts_eval": "prompt",
}
# What issue 6 asks the corpus to cover, by the rule that catches it.
REQUIRED_RULES = {
    "format",  # missing columns
    "consistent_types",  # wrong types
    "text_not_blank",  # empty or whitespace-only strings
    "chosen_differs_from_rejected",
    "valid_roles",
    "has_assistant_turn",
    "ends_with_assistant_turn",  # a last SFT turn that is not the assistant's
    "fits_max_length",
    "no_train_eval_leakage",
    "utf8",
    "json_lines",  # truncated JSONL lines
    "not_empty_file",
    "row_size",  # a huge single row
}
EXAMPLE = re.compile(r"(?:e\.g\. |; )(row|line) (\d+)(?: \(0-based\))?: ")


def case_id(case: dict) -> str:
    return Path(case.get("reported") or next(iter(case["files"].values()))).stem


@pytest.fixture(scope="module")
def good_specs(tmp_path_factory) -> dict[str, DatasetSpec]:
    root = write_data_dir(tmp_path_factory.mktemp("good"), rows=8)
    return {name: DatasetSpec(path=str(root / "datasets" / f"{name}.parquet")) for name in SLOT_KINDS}


@pytest.fixture(scope="module")
def run_ids() -> tuple[str, str]:
    experiment = tracking.experiment_id("test-bad-corpus")
    return experiment, tracking.start_run(experiment, "parent", {})


def test_the_corpus_has_every_file_in_a_case_and_covers_the_issue():
    files = sorted(path.name for path in BAD.iterdir() if path != MANIFEST)
    assert len(files) >= 25
    used = [name for case in CASES for name in case["files"].values()]
    assert sorted(used) == files, "every file is used by exactly one case"
    assert {SLOT_KINDS[slot] for case in CASES for slot in case["files"]} == {"sft", "preference", "prompt"}
    assert REQUIRED_RULES <= {case["rule"] for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_data_stage_rejects_the_file(case, good_specs, run_ids, tmp_path, monkeypatch):
    if "max_row_bytes" in case:
        monkeypatch.setattr(validators.files, "MAX_ROW_BYTES", case["max_row_bytes"])
    bad = {slot: DatasetSpec(path=str(BAD / name)) for slot, name in case["files"].items()}
    # preference_eval is optional: leaving it out where a case does not use it saves a
    # fifth of the test's time (each dataset costs ~0.25 s of Great Expectations Data Docs).
    config = DataConfig(**{**good_specs, "preference_eval": None, **bad})
    experiment, parent = run_ids
    ctx = RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment, parent_run_id=parent)
    max_tokens = case.get("max_tokens")

    with pytest.raises(ValueError) as caught:
        # .fn: the stage's own code, without a Prefect task run around it
        validate_data.fn(config, ctx, model=ModelConfig() if max_tokens else None, max_tokens=max_tokens)

    message = str(caught.value)
    reported = BAD / (case.get("reported") or next(iter(case["files"].values())))
    prefix = f"{reported}: rule '{case['rule']}' failed"
    lines = [line for line in message.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, message
    quoted = [(unit, int(number)) for unit, number in EXAMPLE.findall(lines[0])]
    expected = [("row", row) for row in case.get("rows", [])] + [("line", line) for line in case.get("lines", [])]
    assert quoted == expected, message
    for name in case["files"].values():  # a leak names the training file too
        assert str(BAD / name) in message
    # Only the bad slots fail: the good datasets around them pass.
    assert all(str(BAD) in line for line in message.splitlines() if ": rule '" in line), message

    stage_root = tmp_path / "artifacts" / "data"
    assert sorted(path.name for path in stage_root.iterdir()) == [".leases", ".locks", ".work"], "nothing is published"
    slot = next(slot for slot, name in case["files"].items() if BAD / name == reported)
    # The reports stay in the work dir and record exactly the rules the message names for the file (one line
    # each): files.json holds the raw-file rules, validation.json the dataset rules once the file could be read.
    reports = {path.name: json.loads(path.read_text()) for path in stage_root.glob(f".work/*/report/{slot}/*.json")}
    saved = [report for content in reports.values() for report in (content if isinstance(content, list) else [content])]
    failed = {result["rule"] for report in saved for result in report["rules"] if not result["success"]}
    assert failed == set(re.findall(rf"^{re.escape(str(reported))}: rule '(\w+)' failed", message, flags=re.M)), reports
