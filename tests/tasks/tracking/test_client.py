"""The tracking store as several processes see it at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.deployments.servers import ROOT

OPEN_AT_ONCE = """
import os, sys, time
from pathlib import Path
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.005)
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking import versions
mlflow = tracking.client()
mlflow.search_experiments(max_results=1)
mlflow.search_registered_models(max_results=1)
tracking.experiment_id(f"opened-by-{os.getpid()}")
"""


@pytest.mark.slow  # processes that each import MLflow: ~17 s
def test_processes_that_open_a_new_sqlite_store_at_once_all_get_its_tables(tmp_path):
    """A served deployment's runs, their hooks and `rlhf eval` may open a new store together: without one process at
    a time creating the tables, MLflow's migrations run twice and one process fails ('duplicate column name')."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "opener.py").write_text(OPEN_AT_ONCE)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "RLHF_STATE_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    go = tmp_path / "go"
    openers = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "opener.py"), str(go)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    time.sleep(5)  # every opener has started Python and waits for the word
    go.touch()
    outputs = [opener.communicate(timeout=300) for opener in openers]
    for opener, (_out, err) in zip(openers, outputs, strict=True):
        assert opener.returncode == 0, err[-3000:]
    made = {experiment.name for experiment in MlflowClient(tracking_uri=uri).search_experiments()}
    assert made >= {f"opened-by-{opener.pid}" for opener in openers}
    assert (tmp_path / "store" / "mlflow.db.lock").exists()


def test_a_registered_version_downloads_from_the_default_store_whatever_the_working_directory(tmp_path, monkeypatch):
    """With no MLFLOW_TRACKING_URI the store is the state folder's SQLite file. A version (and a logged model) is
    downloaded through that store, not through MLflow's process-wide default (a new `mlflow.db` in the working
    directory, where the version does not exist: an identical re-run of `rlhf run` failed at eval's champion)."""
    from rlhf_pipeline.tasks.tracking import client as tracking
    from rlhf_pipeline.tasks.tracking import versions

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.setenv("RLHF_STATE_DIR", str(tmp_path / "state"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights")
    experiment = tracking.experiment_id("downloads")
    run_id = tracking.client().create_run(experiment).info.run_id
    model_id, uploaded = tracking.log_model(run_id, experiment, "dpo", folder, "d" * 64, {}, {}, "llama")
    assert uploaded
    version = versions.register_version("rlhf-policy", model_id, run_id, {})

    got = versions.download_version("rlhf-policy", version, tmp_path / "registry" / "v1" / "model")
    assert (got / "model.safetensors").read_bytes() == b"weights"
    logged = tracking.download_logged_model(model_id, tmp_path / "logged" / "model")
    assert (logged / "config.json").read_text() == '{"model_type": "llama"}'
    assert sorted(p.name for p in got.parent.iterdir()) == ["model"]  # no partial folder left
    assert list(elsewhere.iterdir()) == []  # no store made in the working directory
