"""The only module that talks to MLflow.

Runs are addressed by id through `MlflowClient`, never through MLflow's
active-run stack: that stack is per thread, and Prefect runs tasks in worker
threads. One parent run per flow run; one child run per stage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_ENV = "RLHF_STATE_DIR"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
PARAM_VALUE_LIMIT = 6000  # MLflow rejects longer param values


def state_dir() -> Path:
    """Run state (MLflow database and artifacts, stage artifacts, checkpoints): `$RLHF_STATE_DIR` or `<project>/state`."""
    return Path(os.environ.get(STATE_ENV) or PROJECT_ROOT / "state").resolve()


def tracking_uri() -> str:
    # The file store refuses writes in MLflow 3.17 (DESIGN.md): default to SQLite.
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state_dir() / 'mlflow.db'}"


def client():
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def experiment_id(name: str) -> str:
    mlflow = client()
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if tracking_uri().startswith("sqlite:"):  # keep artifacts beside the database, not in ./mlruns
        location = (state_dir() / "mlartifacts" / name).as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


def start_run(experiment: str, run_name: str, tags: dict[str, str], parent_run_id: str | None = None) -> str:
    tags = dict(tags)
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client().create_run(experiment, run_name=run_name, tags=tags)
    return run.info.run_id


def end_run(run_id: str, failed: bool = False) -> None:
    client().set_terminated(run_id, status="FAILED" if failed else "FINISHED")


def set_tags(run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client().log_batch(run_id, tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"sft": {"learning_rate": 3e-3}} -> {"sft.learning_rate": "0.003"}."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            flat[name] = text[:PARAM_VALUE_LIMIT]
    return flat


def log_params(run_id: str, config: dict[str, Any], prefix: str = "") -> None:
    from mlflow.entities import Param

    params = [Param(k, v) for k, v in flatten(config, prefix).items()]
    for start in range(0, len(params), 100):  # MLflow caps a batch at 100 params
        client().log_batch(run_id, params=params[start : start + 100])


def log_metrics(run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client().log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def log_artifacts(run_id: str, local: Path, artifact_path: str | None = None) -> None:
    if local.is_dir():
        client().log_artifacts(run_id, str(local), artifact_path)
    elif local.is_file():
        client().log_artifact(run_id, str(local), artifact_path)


def log_text(run_id: str, text: str, artifact_file: str) -> None:
    client().log_text(run_id, text, artifact_file)


def run_link(run_id: str) -> str:
    """Where a person finds the run: the UI page on a server, else how to open the local UI."""
    uri = tracking_uri()
    run = client().get_run(run_id)
    if uri.startswith("http"):
        return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    return f"run {run_id} in {uri} (open with: mlflow ui --backend-store-uri {uri})"
