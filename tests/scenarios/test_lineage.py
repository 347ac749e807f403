"""MLflow as its users expect (issue 28): every published model an MLflow logged model, datasets as run inputs, context
tags, system metrics; a registered version is enough to evaluate the policy and find its SFT and reward models from a
machine that shares only the tracking server and its artifact store."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhf_pipeline.tasks.store.resources import free_port
from rlhf_pipeline.tasks.tracking import client as tracking
from tests import mlflow_server
from tests.flows.helpers import run

pytestmark = pytest.mark.slow  # a pipeline run against a real tracking server


@pytest.fixture
def tracking_server(tmp_path, monkeypatch):
    """A real `mlflow server` with its own store and artifact folder: the runs' files reach it only over HTTP."""
    port, pid_file = free_port(), tmp_path / "mlflow.pid"
    mlflow_server.start(f"sqlite:///{tmp_path / 'server.db'}", port, pid_file, artifacts=tmp_path / "server-artifacts")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")  # the test's stages take seconds
    yield tmp_path / "server-artifacts"
    mlflow_server.stop(pid_file)


def test_a_second_machine_evaluates_the_champion_and_finds_its_lineage_through_mlflow_alone(
    prefect, tmp_path, monkeypatch, tracking_server, screenshots
):
    from mlflow.tracking import MlflowClient

    from rlhf_pipeline.flows.evaluate import rlhf_eval

    first = tmp_path / "first-machine"
    monkeypatch.setenv(tracking.STATE_ENV, str(first))
    # A sample a second, over 40 dpo steps: the preset's 4 can end before MLflow's monitor takes its first sample.
    monkeypatch.setattr(tracking, "SYSTEM_METRICS_SECONDS", 1.0)
    settings = ("registry.model_name=lineage-test", "experiment_name=lineage", "dpo.max_steps=40")
    trained = run(*settings)
    assert trained.is_completed(), trained.message
    summary = trained.result()
    client = MlflowClient()
    experiment = client.get_experiment_by_name("lineage").experiment_id

    # Every model a stage published is a logged model of its stage's run, with the artifact's digest.
    models = {m.name: m for m in client.search_logged_models([experiment])}
    assert {"sft", "rm", "dpo"} <= set(models), sorted(models)
    for stage in ("sft", "rm", "dpo"):
        model = models[stage]
        assert str(model.status).endswith("READY")
        manifest = tracking.client().get_run(model.source_run_id).data.tags
        assert manifest["rlhf.stage"] == stage
        files = {f.path for f in client.list_logged_model_artifacts(model.model_id)}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files, files
    assert models["dpo"].tags["rlhf.upstream.sft"] == models["sft"].model_id
    assert models["rm"].model_type == "reward-model" and models["dpo"].model_type == "causal-lm"

    # The registered version points at the policy's logged model and names the ones it came from.
    version = client.get_model_version_by_alias("lineage-test", "champion")
    assert version.source == f"models:/{models['dpo'].model_id}"  # as mlflow.register_model makes it
    registered = json.loads(client.get_logged_model(models["dpo"].model_id).tags["mlflow.modelVersions"])
    assert registered == [{"name": "lineage-test", "version": int(version.version)}]
    built_from = json.loads(version.tags["rlhf.lineage"])["models"]
    assert (built_from["sft"], built_from["rm"]) == (models["sft"].model_id, models["rm"].model_id)

    # The dpo run: its datasets and input models, MLflow's context tags, system metrics over time.
    dpo_run = client.get_run(models["dpo"].source_run_id)
    datasets = {d.dataset.name: d for d in dpo_run.inputs.dataset_inputs}
    assert "preference" in datasets, sorted(datasets)
    assert datasets["preference"].dataset.digest
    assert {t.key: t.value for t in datasets["preference"].tags}["mlflow.data.context"] == "training"
    assert {m.model_id for m in dpo_run.inputs.model_inputs} >= {models["sft"].model_id}
    assert models["dpo"].model_id in {m.model_id for m in dpo_run.outputs.model_outputs}
    assert dpo_run.data.tags["mlflow.user"] and dpo_run.data.tags["mlflow.source.name"]
    assert len(dpo_run.data.tags.get("mlflow.source.git.commit", "")) == 40
    system = [key for key in dpo_run.data.metrics if key.startswith("system/")]
    assert "system/cpu_utilization_percentage" in system, sorted(dpo_run.data.metrics)
    assert len(client.get_metric_history(dpo_run.info.run_id, "system/cpu_utilization_percentage")) >= 1

    shows_models_and_datasets_in_the_mlflow_ui(experiment, models, dpo_run, datasets["preference"].dataset, screenshots)

    # A cached re-run links the same logged models: nothing is uploaded twice.
    again = run(*settings)
    assert again.is_completed(), again.message
    assert len(client.search_logged_models([experiment])) == len(models)

    # The second machine: an empty state folder, the same tracking server. The first machine's files are gone.
    shutil.rmtree(first)
    second = tmp_path / "second-machine"
    monkeypatch.setenv(tracking.STATE_ENV, str(second))
    evaluated = rlhf_eval(
        policy="models:/lineage-test@champion",
        experiment_name="lineage",
        eval={"max_prompts": 20, "max_new_tokens": 8},
        return_state=True,
    )
    assert evaluated.is_completed(), evaluated.message
    result = evaluated.result()
    # The same policy on the same held-out prompts, greedy: the same score; the reward model's figures exist, so the
    # reward model came through MLflow too.
    assert result["metrics"]["eval/heldout/policy_exact_match"] == summary["metrics"]["eval/heldout/policy_exact_match"]
    assert result["metrics"]["eval/heldout/sft_exact_match"] == summary["metrics"]["eval/heldout/sft_exact_match"]
    assert any("win_rate_vs_sft" in key for key in result["metrics"]), sorted(result["metrics"])
    downloaded = {p.name for p in (second / "registry" / "models").iterdir()}
    assert downloaded == {models["sft"].model_id, models["rm"].model_id}
    assert not first.exists()


def shows_models_and_datasets_in_the_mlflow_ui(experiment, models, run, dataset, screenshots) -> None:
    """MLflow's own UI in headless Chromium: the experiment's Models tab lists the stages' logged models, and the dpo
    run's page its logged model and the datasets it trained on."""
    from playwright.sync_api import expect

    from tests.browser import chromium

    ui = tracking.ui_url()
    with chromium(screenshots / "mlflow_lineage_failed.png", timeout_s=90) as browser:
        page = browser.page
        page.goto(f"{ui}/#/experiments/{experiment}/models?{tracking.TRAINING_VIEW}")
        for stage in ("sft", "rm", "dpo"):
            expect(page.get_by_role("link", name=stage, exact=True).first).to_be_visible()
        expect(page.get_by_text("Ready")).to_have_count(len(models))
        page.screenshot(path=screenshots / "mlflow_models.png", full_page=True)

        page.goto(tracking.run_url(run.info.run_id))
        # Its model inputs and output: sft in, dpo out (registered), and the dataset it trained on.
        expect(page.get_by_role("heading", name="Logged models (2)")).to_be_visible()
        rows = page.get_by_role("row")
        for kind, stage in (("Input", "sft"), ("Output", "dpo")):
            row = rows.filter(has=page.get_by_role("gridcell", name=kind, exact=True))
            expect(row.get_by_role("link", name=stage, exact=True)).to_be_visible()
        expect(rows.filter(has_text="Output").get_by_role("link", name="lineage-test")).to_be_visible()
        expect(page.get_by_role("button", name=f"{dataset.name} ({dataset.digest})")).to_be_visible()
        page.screenshot(path=screenshots / "mlflow_run_lineage.png", full_page=True)
