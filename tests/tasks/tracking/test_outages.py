"""Faults that lose nothing: a tracking server that goes away mid-training and comes back."""

from __future__ import annotations

import logging
import re

import pytest

from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, RunContext
from rlhf_pipeline.tasks.store.resources import free_port
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.training import train_stage
from rlhf_pipeline.trainers.algorithms.sft import SftConfig
from rlhf_pipeline.trainers.config import CallbackSpec
from tests import mlflow_server
from tests.helpers import FAST, SMALL_MODEL, write_data_dir

pytestmark = pytest.mark.slow  # an MLflow server stopped and started again mid-sft: ~35 s


def test_an_mlflow_server_stopped_mid_sft_and_started_again_loses_no_step_of_the_curve(tmp_path, monkeypatch, caplog):
    port, pid_file = free_port(), tmp_path / "mlflow.pid"
    store = f"sqlite:///{tmp_path / 'outage.db'}"
    mlflow_server.start(store, port, pid_file)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        # MLflow's own retries of one call, cut from minutes to seconds: the outage below outlasts them.
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        experiment = tracking.experiment_id("outage")
        ctx = RunContext(
            artifact_root=str(tmp_path / "artifacts"),
            experiment_id=experiment,
            parent_run_id=tracking.start_run(experiment, "parent", {}),
        )
        data = ArtifactRef(stage="data", key="d", uri=str(write_data_dir(tmp_path / "data", rows=32)))
        outage = {"stop_at": 3, "start_at": 8, "store": store, "port": port, "pid_file": str(pid_file)}
        config = SftConfig(
            max_steps=12, callbacks=[CallbackSpec(path="tests.user_code:MlflowOutage", kwargs=outage)], **FAST
        )
        caplog.set_level(logging.INFO, logger="rlhf")
        outcome = train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)

        assert not outcome.cached and (outcome.ref.path / "model" / "model.safetensors").is_file()
        client = tracking.client()
        assert client.get_run(outcome.mlflow_run_id).info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(outcome.mlflow_run_id, "sft/train/loss")]
        assert sorted(set(steps)) == list(range(1, 13)), steps  # the steps logged while it was down too, in order
        said = caplog.text
        # Step 3's row or step 2's: the queue may still hold step 2's when the server stops.
        assert re.search(r"sft: MLflow did not take the metrics of step [23] ", said), said
        assert "sft: MLflow answers again after" in said
    finally:
        mlflow_server.stop(pid_file)
