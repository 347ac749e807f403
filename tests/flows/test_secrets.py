"""A secret in the environment and one in a config reach none of: MLflow params, tags and
artifacts, manifests, the artifact store, Prefect logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_pipeline.tasks import tracking
from rlhf_pipeline.tasks.secrets import redact
from tests.flows.helpers import run

pytestmark = pytest.mark.e2e  # a pipeline run end to end: the fast loop skips it (-m 'not e2e')

ENV_SECRET = "hf_env_7Hq2LmZp9RwX4vKd"
CONFIG_SECRET = "hf_cfg_3Jt8NcYb5SuE1gFa"


def test_redact_masks_secret_keys_and_env_values_but_not_tokenizer_words(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ENV_SECRET)
    config = {
        "hub_token": CONFIG_SECRET,
        "pad_token": "<|pad|>",
        "max_new_tokens": 12,
        "note": f"pw={ENV_SECRET}",
        "api_key": None,
    }
    assert redact(config) == {
        "hub_token": "***",
        "pad_token": "<|pad|>",
        "max_new_tokens": 12,
        "note": "pw=***",
        "api_key": None,
    }


def files_containing(root: Path, *secrets: str) -> list[str]:
    return [
        str(path)
        for path in root.rglob("*")
        if path.is_file() and any(secret.encode() in path.read_bytes() for secret in secrets)
    ]


def test_secrets_appear_in_no_log_param_artifact_or_manifest(prefect, state, monkeypatch):
    from mlflow.tracking import MlflowClient
    from prefect import get_client, get_run_logger
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from rlhf_pipeline import tasks
    from rlhf_pipeline.tasks.orchestration import prefect_log

    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    evaluate = tasks.eval.run_stage

    def quoting_secrets(*args, **kwargs):  # log lines that quote the secret, as an error message might
        prefect_log(f"connecting with token {ENV_SECRET}")
        get_run_logger().warning(f"retrying {ENV_SECRET}")  # straight to Prefect's logger: the handler filter masks it
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(tasks.eval, "run_stage", quoting_secrets)
    # A config that carries a secret (TRL accepts `hub_token`).
    done = run(f"sft.trl_overrides={{hub_token: {CONFIG_SECRET}}}", f"experiment_name=secrets-{ENV_SECRET[-4:]}")
    assert done.is_completed(), done.message
    flow_run_id = done.state_details.flow_run_id

    mlflow = MlflowClient()
    experiment = mlflow.get_experiment_by_name(f"secrets-{ENV_SECRET[-4:]}").experiment_id
    runs = mlflow.search_runs([experiment])
    assert {r.info.run_name for r in runs} >= {"sft", "dpo", "eval"}
    for r in runs:
        logged = [*r.data.params.values(), *r.data.tags.values()]
        assert not any(ENV_SECRET in v or CONFIG_SECRET in v for v in logged), r.info.run_name
    sft_run = next(r for r in runs if r.info.run_name == "sft")
    masked = {k: v for k, v in sft_run.data.params.items() if k.endswith("trl_overrides.hub_token")}
    assert list(masked.values()) == ["***"], masked  # masked, not dropped

    # MLflow's artifact store (config.yaml, reports, manifests, the model) and the stage artifacts.
    assert files_containing(tracking.state_dir(), ENV_SECRET, CONFIG_SECRET) == []
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    assert not any(ENV_SECRET in log.message or CONFIG_SECRET in log.message for log in logs)
    assert {"connecting with token ***", "retrying ***"} <= {log.message for log in logs}
