"""The `data` stage (tasks/data.py) on good data: token limits enter its key and its report."""

from __future__ import annotations

import json

import pytest

from rlhf_pipeline.tasks.data import validate_data
from rlhf_pipeline.tasks.store.artifacts import RunContext
from rlhf_pipeline.tasks.tracking import client as tracking
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


def jsonl(path, rows: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def frozen(outcome, name: str) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(outcome.path / "datasets" / f"{name}.parquet").column("text").to_pylist()


def test_a_file_rewritten_with_the_same_time_and_size_is_keyed_and_frozen_by_its_new_bytes(ctx, tmp_path):
    import os

    path = jsonl(tmp_path / "sft.jsonl", [{"text": "alpha"}, {"text": "bravo"}])
    stamp = path.stat().st_mtime_ns
    config = DataConfig(sft=DatasetSpec(path=str(path)), preference=None, preference_eval=None, prompts=None)
    first = validate_data.fn(config, ctx)
    jsonl(path, [{"text": "ALPHA"}, {"text": "BRAVO"}])  # same size
    os.utime(path, ns=(stamp, stamp))  # and the same modification time: `datasets`' cache cannot tell
    second = validate_data.fn(config, ctx)
    assert second.key != first.key
    assert frozen(first, "sft") == ["alpha", "bravo"] and frozen(second, "sft") == ["ALPHA", "BRAVO"]


def test_a_file_that_changes_while_it_is_read_fails_the_attempt_as_transient(tmp_path):
    from rlhf_pipeline.tasks.orchestration.stage_task import is_permanent
    from rlhf_pipeline.trainers.data import DataChanged, dataset_fingerprint, load_source

    spec = DatasetSpec(path=str(jsonl(tmp_path / "sft.jsonl", [{"text": "alpha"}])))
    keyed = dataset_fingerprint(spec)
    assert load_source(spec, keyed)["text"] == ["alpha"]
    jsonl(tmp_path / "sft.jsonl", [{"text": "changed"}])
    with pytest.raises(DataChanged, match="the files changed while the data stage read them") as changed:
        load_source(spec, keyed)
    assert not is_permanent(changed.value)  # retried: the retry keys the new bytes


def test_a_folder_is_a_local_dataset_keyed_by_its_files_checked_raw_and_of_one_format(ctx, tmp_path):
    from rlhf_pipeline.trainers.data import dataset_fingerprint
    from rlhf_pipeline.validators.report import DataValidationError

    folder = tmp_path / "sft"
    jsonl(folder / "a.jsonl", [{"text": "alpha"}])
    jsonl(folder / "b.jsonl", [{"text": "bravo"}])
    spec = DatasetSpec(path=str(folder))
    config = DataConfig(sft=spec, preference=None, preference_eval=None, prompts=None)
    before = dataset_fingerprint(spec)
    assert before.startswith("sha256:")  # its files' bytes, not its name
    assert sorted(frozen(validate_data.fn(config, ctx), "sft")) == ["alpha", "bravo"]
    jsonl(folder / "c.jsonl", [{"text": "charlie"}])  # a new file is new data
    assert dataset_fingerprint(spec) != before
    assert sorted(frozen(validate_data.fn(config, ctx), "sft")) == ["alpha", "bravo", "charlie"]

    (folder / "d.jsonl").write_text('{"text": "cut off\n')  # the raw checks run on a folder's files
    with pytest.raises(DataValidationError, match=r"(?s)d\.jsonl.*json_lines"):
        validate_data.fn(config, ctx)
    (folder / "d.jsonl").unlink()
    jsonl(folder / "e.parquet", [])  # a second format
    with pytest.raises(ValueError, match=r"holds one format, this one several \(\.jsonl: a\.jsonl, b\.jsonl"):
        validate_data.fn(config, ctx)
    (folder / "e.parquet").unlink()
    (folder / "notes.txt").write_text("not data")
    with pytest.raises(ValueError, match="holds data files only .*; notes.txt is not one"):
        validate_data.fn(config, ctx)


def test_the_data_stage_says_how_many_rows_repeat_and_which(small_data, ctx, tmp_path, caplog):
    import logging

    from tests.helpers import write_jsonl

    rows = [{"prompt": f"sort {n}1 -> ", "chosen": f"1{n}", "rejected": f"{n}1"} for n in range(2, 9)]
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [*rows, rows[1]])
    caplog.set_level(logging.INFO, logger="rlhf")
    validate_data.fn(small_data.model_copy(update={"preference": DatasetSpec(path=str(prefs))}), ctx)
    said = [m for m in caplog.messages if "repeat an earlier row" in m]
    assert said == [
        f"data: {prefs}: 1 of 8 rows repeat an earlier row exactly (e.g. row 7: same as row 1); kept, and reported as "
        "rule no_duplicate_rows"
    ]


def test_failed_checks_are_a_prefect_table_and_passed_ones_link_their_data_docs(
    prefect, small_data, ctx, tmp_path, monkeypatch
):
    """A data task whose checks fail leaves a table artifact naming file, rule and rows before it fails; one that
    passes links each dataset's Data Docs (the state folder's GX history site) from Prefect and from MLflow."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from tests.helpers import write_jsonl

    state = tmp_path / "state"
    monkeypatch.setenv(tracking.STATE_ENV, str(state))
    rows = [{"prompt": f"sort {n}1 -> ", "chosen": f"1{n}", "rejected": f"{n}1"} for n in range(2, 9)]
    rows[2]["rejected"] = rows[2]["chosen"]
    rows[5]["rejected"] = rows[5]["chosen"]
    bad = write_jsonl(tmp_path / "prefs.jsonl", rows)
    broken = small_data.model_copy(update={"preference": DatasetSpec(path=str(bad))})

    @flow
    def check(config: DataConfig):
        return validate_data(config, ctx)

    def artifacts(run_state, key: str) -> list:
        with get_client(sync_client=True) as client:
            return client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=[key]),
                    flow_run_id=ArtifactFilterFlowRunId(any_=[run_state.state_details.flow_run_id]),
                )
            )

    failed = check(broken, return_state=True)
    assert failed.is_failed()
    [table] = artifacts(failed, "rlhf-data-report")
    assert table.type == "table"
    assert json.loads(table.data) == [
        {
            "dataset": "preference",
            "file": str(bad),
            "rule": "chosen_differs_from_rejected",
            "rows failed": 2,
            "example rows": "row 2: chosen == rejected == '14'; row 5: chosen == rejected == '17'",
        }
    ]

    passed = check(small_data, return_state=True)
    assert passed.is_completed()
    ref = passed.result()
    [docs] = artifacts(passed, "rlhf-data-docs")
    history = state / "gx" / "uncommitted" / "data_docs" / "local_site"
    tags = tracking.client().get_run(ref.manifest()["mlflow_run_id"]).data.tags
    for name in DataConfig().sources():
        link = tags[f"rlhf.data_docs.{name}"]
        assert link.startswith(history.as_uri() + "/validations/" + name + "/") and link in docs.data
        assert (ref.path / "report" / name / "data_docs").is_dir()  # this run's pages, logged to MLflow with the report
