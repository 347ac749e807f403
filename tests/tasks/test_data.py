"""The `data` stage (tasks/data.py) on good data: token limits enter its key and its report."""

from __future__ import annotations

import json

import pytest

from rlhf_pipeline.tasks import tracking
from rlhf_pipeline.tasks.artifacts import RunContext
from rlhf_pipeline.tasks.data import validate_data
from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.data import DataConfig, DatasetSpec
from tests.helpers import write_data_dir


@pytest.fixture
def small_data(tmp_path) -> DataConfig:
    root = write_data_dir(tmp_path / "good", rows=8)
    names = DataConfig().sources()  # the datasets a default run reads (sft_eval is optional and off)
    return DataConfig(**{name: DatasetSpec(path=str(root / "datasets" / f"{name}.parquet")) for name in names})


@pytest.fixture
def ctx(tmp_path) -> RunContext:
    experiment = tracking.experiment_id("test-data")
    parent = tracking.start_run(experiment, "parent", {})
    return RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment, parent_run_id=parent)


def test_token_limits_enter_the_key_and_the_report(small_data, ctx):
    plain = validate_data.fn(small_data, ctx)
    limited = validate_data.fn(small_data, ctx, model=ModelConfig(), max_tokens={"sft": 64, "prompts_eval": 32})
    assert plain.key != limited.key
    assert limited.manifest()["config"]["max_tokens"] == {"prompts_eval": 32, "sft": 64}
    report = json.loads((limited.path / "report" / "sft" / "validation.json").read_text())
    assert {"rule": "fits_max_length", "success": True} == {k: report["rules"][-1][k] for k in ("rule", "success")}
    unlimited = json.loads((plain.path / "report" / "sft" / "validation.json").read_text())
    assert "fits_max_length" not in [rule["rule"] for rule in unlimited["rules"]]
    rows = {name: value for name, value in limited.manifest()["metrics"].items() if name.endswith("/rows")}
    assert rows == {f"data/{name}/rows": 8.0 for name in DataConfig().sources()}  # all 8 rows of each dataset, frozen
    held_out = json.loads((limited.path / "report" / "prompts_eval" / "validation.json").read_text())
    assert held_out["rules"][-1]["rule"] == "no_train_eval_leakage" and held_out["success"]
    assert sorted(p.name for p in (limited.path / "datasets").iterdir()) == [
        f"{n}.parquet" for n in sorted(DataConfig().sources())
    ]


@pytest.mark.parametrize(
    "model, max_tokens, error",
    [
        (ModelConfig(), {"rm": 64}, r"unknown datasets \['rm'\]"),
        (ModelConfig(), {"sft": 0}, r"positive token counts, got \{'sft': 0\}"),
        (None, {"sft": 64}, "needs the model"),
    ],
)
def test_token_limits_are_checked_before_any_file_is_read(model, max_tokens, error, ctx, tmp_path):
    missing = DataConfig(sft=DatasetSpec(path=str(tmp_path / "nowhere.jsonl")))
    with pytest.raises(ValueError, match=error):
        validate_data.fn(missing, ctx, model=model, max_tokens=max_tokens)
