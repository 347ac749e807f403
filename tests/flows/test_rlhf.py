"""End to end on the embedded default (shrunk to seconds): stages, caching, MLflow, bad data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.helpers import (
    DPO_RUN_STAGES,
    assert_a_flat_graph,
    building_threads,
    data_running_before_the_next_submission,
    graph_of,
    run,
    task_states,
)

pytestmark = pytest.mark.slow  # a pipeline run end to end: the fast loop skips it (-m 'not slow')


def run_without_registry(*overrides: str):
    """The registry's champion is an input of eval; keep it out of the caching test (see test_registry). An experiment
    of its own, so that its searches find only its own runs."""
    return run("registry.enabled=false", "experiment_name=caching", *overrides)


def test_pipeline_runs_caches_and_reruns_only_what_changed(prefect, state, monkeypatch):
    with monkeypatch.context() as patched:
        data_running_before_the_next_submission(patched)  # as under a real server, so the graph below is what users see
        threads = building_threads(patched)
        first = run_without_registry()
    assert first.is_completed(), first.message
    # Every stage built on the one thread of the flow's runner: one OpenMP pool (`stage_task.stage_runner`).
    assert set(threads) == set(DPO_RUN_STAGES) and len(set(threads.values())) == 1, threads
    # The stages' own logs, without Prefect's warning about timeouts in worker threads on every stage.
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:  # shipped in batches from a worker thread: the last ones may arrive after the run has ended
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[first.state_details.flow_run_id])))
            messages = [log.message for log in logs]
            if any(message.startswith("eval: done in") for message in messages) or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert any(message.startswith("eval: done in") for message in messages), messages
    assert not [message for message in messages if "running in a worker thread" in message]
    assert task_states(first) == {stage: "Completed" for stage in DPO_RUN_STAGES}
    # The Prefect UI's graph: every stage a top-level node with its upstream edges (issue 16).
    assert_a_flat_graph(graph_of(first.state_details.flow_run_id), DPO_RUN_STAGES)
    summary = first.result()
    assert set(summary["artifacts"]) == set(DPO_RUN_STAGES)
    eval_manifest = json.loads((Path(summary["artifacts"]["eval"]) / "manifest.json").read_text())
    assert (
        summary["metrics"]["eval/heldout/sft_exact_match"] == eval_manifest["metrics"]["eval/heldout/sft_exact_match"]
    )

    # MLflow: one parent, five children with params and metrics, and the artifacts.
    client = MlflowClient()
    parent = client.get_run(summary["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == sorted(DPO_RUN_STAGES)
    by_stage = {r.info.run_name: r for r in children}
    assert by_stage["dpo"].data.params["dpo.beta"] == "0.1"
    assert len(client.get_metric_history(by_stage["sft"].info.run_id, "sft/train/loss")) >= 4
    assert "rm/eval/accuracy" in by_stage["rm"].data.metrics
    assert "eval/heldout/policy_exact_match" in parent.data.metrics
    top = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"config.yaml", "eval"} <= top and "model" not in top  # the weights: the dpo run's logged model, linked
    policy_model = client.get_logged_model(parent.data.tags["rlhf.policy_model_id"])
    # The dpo run's output; another test's run of the same preset in this store may have logged these bytes first.
    assert policy_model.model_id in {m.model_id for m in by_stage["dpo"].outputs.model_outputs}
    dpo_digest = json.loads((Path(summary["artifacts"]["dpo"]) / "manifest.json").read_text())["digest"]
    assert policy_model.tags["rlhf.model_digest"] == dpo_digest
    assert parent.data.tags["rlhf.model_uri"] == policy_model.artifact_location
    assert "model.safetensors" in {a.path for a in client.list_logged_model_artifacts(policy_model.model_id)}
    assert {a.path for a in client.list_artifacts(by_stage["data"].info.run_id, "report")} >= {
        "report/sft",
        "report/preference",
    }
    assert "samples.jsonl" in {a.path for a in client.list_artifacts(by_stage["eval"].info.run_id)}

    # Identical second run: nothing trains.
    second = run_without_registry()
    assert task_states(second) == {stage: "Cached" for stage in DPO_RUN_STAGES}
    assert second.result()["artifacts"] == summary["artifacts"]
    cached = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{second.result()['mlflow_run_id']}'"
    )
    assert len(cached) == 5 and all(r.data.tags["rlhf.cached"] == "true" for r in cached)
    # A cached run links the same logged model; it does not copy the weights.
    again = client.get_run(second.result()["mlflow_run_id"])
    assert "model" not in {a.path for a in client.list_artifacts(again.info.run_id)}
    assert again.data.tags["rlhf.model_uri"] == policy_model.artifact_location

    # Only dpo.beta changed: only dpo and eval run.
    third = run_without_registry("dpo.beta=0.2")
    assert task_states(third) == {
        "data": "Cached",
        "sft": "Cached",
        "rm": "Cached",
        "dpo": "Completed",
        "eval": "Completed",
    }

    # A deleted artifact directory re-runs that stage, and only what depends on it:
    # eval reads the reward model, dpo does not. Eval re-runs exactly when the
    # re-produced reward model's bytes differ (training is usually, not always,
    # bit-reproducible on CPU across thread schedules).
    rm_digest = json.loads((Path(summary["artifacts"]["rm"]) / "manifest.json").read_text())["digest"]
    shutil.rmtree(summary["artifacts"]["rm"])
    fourth = run_without_registry()
    same_bytes = json.loads((Path(summary["artifacts"]["rm"]) / "manifest.json").read_text())["digest"] == rm_digest
    expected_eval = "Cached" if same_bytes else "Completed"
    assert task_states(fourth) == {
        "data": "Cached",
        "sft": "Cached",
        "rm": "Completed",
        "dpo": "Cached",
        "eval": expected_eval,
    }

    # A re-produced upstream with different bytes re-keys everything downstream.
    sft_dir = Path(summary["artifacts"]["sft"])
    manifest = json.loads((sft_dir / "manifest.json").read_text())
    (sft_dir / "manifest.json").write_text(json.dumps({**manifest, "digest": "different-bytes"}))
    fifth = run_without_registry()
    assert task_states(fifth) == {
        "data": "Cached",
        "sft": "Cached",
        "rm": "Completed",
        "dpo": "Completed",
        "eval": "Completed",
    }

    # --no-cache re-runs everything.
    sixth = run_without_registry("no_cache=true")
    assert task_states(sixth) == {stage: "Completed" for stage in DPO_RUN_STAGES}


def test_corrupted_preferences_stop_the_flow_in_data(prefect, state, tmp_path):
    rows = [json.loads(line) for line in open("data/sort/preference.jsonl")][:50]
    rows[3]["chosen"] = ""
    rows[7]["rejected"] = rows[7]["chosen"]
    bad = tmp_path / "bad_preference.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))

    result = run(f"data.preference.path={bad}")
    assert result.is_failed()
    states = task_states(result)
    assert states["data"] == "Failed"
    assert all(states.get(stage) in (None, "NotReady") for stage in [*DPO_RUN_STAGES[1:], "registry"])
    message = str(result.result(raise_on_failure=False))
    assert "bad_preference.jsonl" in message
    assert "text_not_blank" in message and "row 3" in message
    assert "chosen_differs_from_rejected" in message and "row 7" in message
    artifacts = state / "artifacts"
    assert not (artifacts / "sft").exists() and not any((artifacts / "data").glob("[0-9a-f]*"))
    # The Data Docs named in the message outlive the failure.
    docs = message.rsplit("Data Docs: ", 1)[1].split()[0]
    assert Path(docs).is_file()


def test_a_run_keeps_a_name_a_person_gave_and_only_replaces_the_one_prefect_made():
    """The UI's Run Name (or `--flow-run-name`) is kept; Prefect's adjective-animal name for an unnamed run is what the
    flow replaces with `<algorithm>-<preset>-<id>` (issue 44)."""
    from prefect.utilities.names import generate_slug

    from rlhf_pipeline.flows.rlhf import prefect_made

    assert all(prefect_made(generate_slug(2)) for _ in range(500))
    given = ["beta sweep 0.123", "my-baseline", "dpo-tiny-3f9a2c", "alpha927-sulafat", "Free-Bittern"]
    assert [name for name in given if prefect_made(name)] == []
