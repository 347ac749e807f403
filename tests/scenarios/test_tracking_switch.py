"""The artifact store and the tracking store are independent: a new MLflow store keeps every cached stage."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.helpers import DPO_RUN_STAGES, run, task_states

pytestmark = pytest.mark.slow


def test_a_new_empty_tracking_store_gets_every_run_from_the_artifacts(prefect, state, tmp_path, monkeypatch):
    old_store = f"sqlite:///{tmp_path / 'before' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", old_store)
    first = run()
    assert first.is_completed(), first.message
    produced = first.result()

    # The team moves to a new tracking server (here: a fresh database in a folder that does not exist yet).
    new_store = f"sqlite:///{tmp_path / 'after' / 'new' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_store)
    second = run()
    assert second.is_completed(), second.message
    assert task_states(second) == {**dict.fromkeys(DPO_RUN_STAGES, "Cached"), "registry": "Completed"}

    client = MlflowClient(tracking_uri=new_store)
    summary = second.result()
    parent = client.get_run(summary["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_stage = {r.info.run_name: r for r in children}
    assert set(by_stage) == {*DPO_RUN_STAGES, "registry"}
    for stage in DPO_RUN_STAGES:
        tags = by_stage[stage].data.tags
        assert tags["rlhf.cached"] == "true"
        assert tags["rlhf.produced_by_missing"].startswith(f"run {tags['rlhf.produced_by']} is not in {new_store}")
    # Metrics and curves come from the artifacts: the cached sft run has its whole loss curve.
    assert len(client.get_metric_history(by_stage["sft"].info.run_id, "sft/train/loss")) >= 4
    old_rm = MlflowClient(tracking_uri=old_store).get_run(by_stage["rm"].data.tags["rlhf.produced_by"])
    assert by_stage["rm"].data.metrics["rm/eval/accuracy"] == old_rm.data.metrics["rm/eval/accuracy"]
    # The parent holds the evaluation: its metrics, the report and the plots (training curves from the artifacts).
    assert (
        parent.data.metrics["eval/heldout/policy_exact_match"] == produced["metrics"]["eval/heldout/policy_exact_match"]
    )
    top = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"eval", "plots"} <= top and "model" not in top
    # The weights: the cached dpo run's logged model, uploaded to the new store from the artifacts and linked.
    policy_model = client.get_logged_model(parent.data.tags["rlhf.policy_model_id"])
    assert policy_model.model_id in {m.model_id for m in by_stage["dpo"].outputs.model_outputs}
    assert "model.safetensors" in {a.path for a in client.list_logged_model_artifacts(policy_model.model_id)}
    assert "plots/training_curves.png" in {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    # The registry of the new store starts over: the policy becomes its first version and champion.
    assert summary["registry"]["version"] == "1" and summary["registry"]["promoted"]
