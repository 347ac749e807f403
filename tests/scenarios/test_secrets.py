"""A secret in the environment and one in a config reach none of: MLflow params, tags and
artifacts, manifests, the artifact store, Prefect logs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlhf_pipeline.tasks.store.secrets import redact
from rlhf_pipeline.tasks.tracking import client as tracking
from tests.flows.helpers import run
from tests.prefect_db import seeded

pytestmark = pytest.mark.slow  # a pipeline run end to end: the fast loop skips it (-m 'not slow')

ENV_SECRET = "hf_env_7Hq2LmZp9RwX4vKd"
CONFIG_SECRET = "hf_cfg_3Jt8NcYb5SuE1gFa"
DB_PASSWORD = "pg-Wq7x2Lm9"
DATABASE_URL = f"postgresql://rlhf:{DB_PASSWORD}@db.internal:5432/mlflow"
CONFIG_URI = "https://bot:cfgUriPass4@hub.internal/org/policy"
EVERY = (ENV_SECRET, CONFIG_SECRET, DB_PASSWORD, "cfgUriPass4")
NOTIFY = (
    f"sft.callbacks=[{{path: tests.user_code:Notify, kwargs: {{api_key: {CONFIG_SECRET}, endpoint: '{CONFIG_URI}'}}}}]"
)


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

    from rlhf_pipeline.tasks import eval as eval_stage  # imported here: no other test of this worker may have
    from rlhf_pipeline.tasks.orchestration.stage_task import prefect_log

    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    monkeypatch.setenv("DATABASE_URL", DATABASE_URL)  # a variable named like no secret, with a password in its URI
    evaluate = eval_stage.run_stage

    def quoting_secrets(*args, **kwargs):  # log lines that quote the secret, as an error message might
        prefect_log(f"connecting with token {ENV_SECRET} to {DATABASE_URL}")
        get_run_logger().warning(f"retrying {ENV_SECRET}")  # straight to Prefect's logger: the handler filter masks it
        try:
            raise ConnectionError(f"refused: {DATABASE_URL}, password {DB_PASSWORD}")
        except ConnectionError:
            get_run_logger().exception("the traceback is masked too")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(eval_stage, "run_stage", quoting_secrets)
    # A config that carries a secret (a callback's API key) and a URI with a password.
    done = run(
        NOTIFY,
        f"experiment_name=secrets-{ENV_SECRET[-4:]}",
    )
    assert done.is_completed(), done.message
    flow_run_id = done.state_details.flow_run_id

    mlflow = MlflowClient()
    experiment = mlflow.get_experiment_by_name(f"secrets-{ENV_SECRET[-4:]}").experiment_id
    runs = mlflow.search_runs([experiment])
    assert {r.info.run_name for r in runs} >= {"sft", "dpo", "eval"}
    for r in runs:
        logged = [*r.data.params.values(), *r.data.tags.values()]
        assert not any(secret in v for v in logged for secret in EVERY), r.info.run_name
    sft_run = next(r for r in runs if r.info.run_name == "sft")
    masked = {k: v for k, v in sft_run.data.params.items() if "callbacks" in k}
    assert any("api_key" in v and "***" in v for v in masked.values()), masked  # masked, not dropped

    # MLflow's artifact store (config.yaml, reports, manifests, the model) and the stage artifacts.
    assert files_containing(tracking.state_dir(), *EVERY) == []
    quoted = {"connecting with token *** to postgresql://***@db.internal:5432/mlflow", "retrying ***"}
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        # Prefect ships logs in batches from a worker thread: the run's last ones may reach the server after the run
        # has ended (seen when this test's flow was the first on a freshly started server).
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            if quoted <= {log.message for log in logs} or time.monotonic() > deadline:
                break
            time.sleep(1)
        artifacts = client.read_artifacts()
    assert not any(secret in log.message for log in logs for secret in EVERY)
    messages = {log.message for log in logs}
    assert quoted <= messages
    [traceback] = [message for message in messages if message.startswith("the traceback is masked too")]
    assert "ConnectionError: refused: postgresql://***@db.internal" in traceback and "password ***" in traceback
    assert not any(secret in str(artifact.data) for artifact in artifacts for secret in EVERY)  # Prefect's artifacts
    assert any("https://***@hub.internal/org/policy" in v for v in masked.values()), masked


def test_every_uri_credential_secret_name_and_short_secret_is_masked_and_settings_are_not(monkeypatch):
    from rlhf_pipeline.tasks.store.secrets import redact_text

    monkeypatch.setenv("DATABASE_URL", DATABASE_URL)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "DefaultEndpointsProtocol=https;AccountKey=azK3y==")
    monkeypatch.setenv("APP_PASSWORD", "pw7q")  # short, still a secret
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # named like one, a setting
    monkeypatch.setenv("GIT_REMOTE_URL", "ssh://git@github.com/org/repo")  # a user name alone is no secret
    text = (
        f"{DB_PASSWORD} | redis://:r3disPass@cache:6379 | https://ghp_abcdefgh1234@github.com/x | pw7q | "
        "AccountKey=azK3y== | DefaultEndpointsProtocol=https;AccountKey=azK3y== | parallel: false | git clone"
    )
    assert redact_text(text) == (
        "*** | redis://***@cache:6379 | https://***@github.com/x | *** | AccountKey=azK3y== | *** | parallel: false | "
        "git clone"
    )
    config = {
        "aws_secret_access_key": "AKIAsecret",
        "headers": {"Authorization": "Bearer abc", "X-Api-Key": "k", "Accept": "json"},
        "storage": {"connection_string": "c", "sas_token": "s", "access_key_id": "a"},
        "tracking": "http://u:p4ssw0rd@mlflow:5000",
    }
    assert redact(config) == {
        "aws_secret_access_key": "***",
        "headers": {"Authorization": "***", "X-Api-Key": "***", "Accept": "json"},
        "storage": {"connection_string": "***", "sas_token": "***", "access_key_id": "***"},
        "tracking": "http://***@mlflow:5000",
    }


def test_rlhf_params_and_its_errors_mask_secrets(capsys):
    from rlhf_pipeline.cli import main

    assert main(["params", "--set", NOTIFY]) == 0
    shown = capsys.readouterr().out
    assert CONFIG_SECRET not in shown and "cfgUriPass4" not in shown and '"api_key": "***"' in shown
    assert main(["params", "--set", f"experiment_name={{bad: '{CONFIG_URI}'}}"]) == 2
    assert "cfgUriPass4" not in capsys.readouterr().err


def test_launch_json_holds_no_secret_and_the_ranks_get_them_by_environment(tmp_path, monkeypatch):
    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.tasks.store.secrets import redact
    from rlhf_pipeline.trainers.runtime.rank import SECRETS_ENV, read_spec, write_spec

    sft = load_params(
        "tiny", [f"sft.callbacks=[{{path: tests.user_code:Notify, kwargs: {{api_key: {CONFIG_SECRET}}}}}]"]
    ).sft
    spec = tmp_path / "launch.json"
    hidden = write_spec(
        spec, "rlhf_pipeline.trainers.algorithms.sft", {"cfg": sft, "steps": 3, "out": tmp_path}, mask=redact
    )
    assert CONFIG_SECRET not in spec.read_text() and '"api_key": "***"' in spec.read_text()
    assert list(hidden) == ["cfg"]
    monkeypatch.setenv(SECRETS_ENV, json.dumps(hidden))
    trainer, arguments = read_spec(spec)
    assert arguments == {"cfg": sft, "steps": 3, "out": tmp_path}  # the ranks train with the real value


def test_the_reachability_check_sends_the_uris_credentials_as_mlflow_does_and_never_shows_them(monkeypatch):
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    expected = "Basic " + base64.b64encode(b"bot:s3cret/pass").decode()

    class Health(BaseHTTPRequestHandler):  # a tracking server behind basic authentication: /health answers 401
        def do_GET(self):
            self.send_response(200 if self.headers.get("Authorization") == expected else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bot:s3cret%2Fpass@127.0.0.1:{port}")
        tracking.check_reachable()  # healthy, with the URI's (URL-encoded) credentials
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bot:wrongpass@127.0.0.1:{port}")
        with pytest.raises(ConnectionError, match="HTTP 401") as refused:
            tracking.check_reachable()
        assert "wrongpass" not in str(refused.value) and f"http://***@127.0.0.1:{port}" in str(refused.value)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bot")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret/pass")
        tracking.check_reachable()  # MLflow's own variables
        assert tracking.ui_url() == f"http://127.0.0.1:{port}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bot:wrongpass@127.0.0.1:{port}")
        assert tracking.ui_url() == f"http://127.0.0.1:{port}" and "wrongpass" not in tracking.shown_uri()
    finally:
        server.shutdown()


def test_query_string_secrets_and_sas_signatures_are_masked_wherever_a_uri_appears():
    from rlhf_pipeline.tasks.store.secrets import redact_text

    sas = "https://acct.blob.core.windows.net/data/prefs.parquet?sv=2022-11-02&sr=b&sig=Zk9%2BqW3xLm7%3D&se=2027"
    presigned = "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAEXAMPLE%2F1&X-Amz-Signature=9f8e7d6c5b4a"
    text = redact_text(f"reading {sas} and {presigned}, then http://h:5000/api?token=tok-8Hq2Lm9 and ?page=2")
    assert "Zk9" not in text and "AKIAEXAMPLE" not in text and "9f8e7d6c5b4a" not in text and "tok-8Hq2Lm9" not in text
    assert "sv=2022-11-02&sr=b&sig=***&se=2027" in text and "?page=2" in text  # only the secrets go


def test_a_run_against_a_tracking_server_with_a_password_prints_logs_and_keeps_it_nowhere(tmp_path):
    """`rlhf run` as a user starts it, against a real tracking server whose URI carries a password: not on stdout
    (MLflow's own "View run ... at <URI>" lines included), stderr, the Prefect logs, the run state or the server's
    store."""
    import os
    import subprocess
    import sys

    from rlhf_pipeline.tasks.store.resources import free_port
    from tests import mlflow_server
    from tests.helpers import CI_PRESET

    password = "Trk-9fQ2mZ7xLpVw"
    port, pid_file = free_port(), tmp_path / "mlflow.pid"
    mlflow_server.start(f"sqlite:///{tmp_path / 'server.db'}", port, pid_file, artifacts=tmp_path / "server-artifacts")
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"http://rlhf:{password}@127.0.0.1:{port}",
        "PREFECT_HOME": seeded(tmp_path / "prefect"),
        "RLHF_STATE_DIR": str(tmp_path / "state"),
    }
    env.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)  # the pipeline's to set, not the test's
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rlhf_pipeline", "run", "--config", CI_PRESET, "--set", "registry.enabled=false"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        mlflow_server.stop(pid_file)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert password not in done.stdout + done.stderr
    assert "View run" not in done.stdout and f"127.0.0.1:{port}" in done.stdout  # the closing table's link
    assert (tmp_path / "prefect" / "prefect.db").is_file() and (tmp_path / "state" / "artifacts").is_dir()
    assert files_containing(tmp_path, password) == []
