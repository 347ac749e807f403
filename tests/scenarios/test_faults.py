"""Transient failures retry with backoff and the flow completes; permanent ones fail at once."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest

from rlhf_pipeline.tasks import registry
from tests.flows.helpers import run, task_runs
from tests.scenarios.test_online import ONLINE_FAST

STAGE_MODULES = ["rlhf_pipeline.tasks.data", "rlhf_pipeline.tasks.training", "rlhf_pipeline.tasks.eval"]
NO_WAIT = ["retry.delay_seconds=[0]", "retry.jitter_factor=0"]


def inject(monkeypatch, error: Exception, only: str | None = None) -> Counter:
    """Make the first attempt of every stage (or of `only`) raise `error`; count the attempts."""
    attempts: Counter = Counter()

    def failing_first(original):
        def attempt(stage, *args, **kwargs):
            attempts[stage] += 1
            if attempts[stage] == 1 and only in (None, stage):
                raise error
            return original(stage, *args, **kwargs)

        return attempt

    for module in STAGE_MODULES:
        monkeypatch.setattr(f"{module}.run_stage", failing_first(importlib.import_module(module).run_stage))
    register = registry.register_policy
    monkeypatch.setattr(
        registry,
        "register_policy",
        lambda *a, **k: failing_first(lambda _, *a, **k: register(*a, **k))("registry", *a, **k),
    )
    return attempts


def run_counts(flow_state) -> dict[str, tuple[str, int]]:
    return {r.name: (r.state.type.value, r.run_count) for r in task_runs(flow_state.state_details.flow_run_id)}


@pytest.mark.slow
def test_every_stage_survives_a_transient_failure_with_one_retry(prefect, state, monkeypatch):
    attempts = inject(monkeypatch, ConnectionError("injected: the tracking server dropped the connection"))
    dpo = run(*NO_WAIT)
    assert dpo.is_completed(), dpo.message
    stages = ["data", "sft", "rm", "dpo", "eval", "registry"]
    assert run_counts(dpo) == {stage: ("COMPLETED", 2) for stage in stages}
    assert attempts == Counter({stage: 2 for stage in stages})

    attempts.clear()
    ppo = run(*ONLINE_FAST, "algorithm=ppo", *NO_WAIT)  # the online stages too (tasks.training)
    assert ppo.is_completed(), ppo.message
    assert run_counts(ppo)["ppo"] == ("COMPLETED", 2) and attempts["ppo"] == 2


@pytest.mark.slow
def test_a_permanent_failure_is_not_retried(prefect, state, monkeypatch):
    attempts = inject(monkeypatch, ValueError("injected: rm.max_length does not fit the data"), only="rm")
    failed = run(*NO_WAIT)
    assert failed.is_failed()
    counts = run_counts(failed)
    assert counts["rm"] == ("FAILED", 1) and attempts["rm"] == 1
    assert counts["dpo"] == ("PENDING", 0)  # nothing after it trained
    assert "ValueError: injected: rm.max_length does not fit the data" in failed.message


def test_a_stage_that_times_out_fails_and_kills_its_child_processes(prefect, tmp_path):
    import subprocess
    import time

    import psutil
    from prefect import flow, task

    from rlhf_pipeline.tasks.config import RetryConfig
    from rlhf_pipeline.tasks.orchestration.stage_task import retrying
    from rlhf_pipeline.tasks.store.artifacts import RunContext
    from rlhf_pipeline.tasks.tracking import client as tracking
    from tests.helpers import recorded_stage

    experiment = tracking.experiment_id("timeout-test")
    ctx = RunContext(
        artifact_root=str(tmp_path),
        experiment_id=experiment,
        parent_run_id=tracking.start_run(experiment, "parent", {}),
    )
    spawned: list[int] = []

    def hanging_build(out_dir, work_dir, log_metrics):
        spawned.append(subprocess.Popen(["sleep", "120"]).pid)  # a worker that would outlive the stage
        while True:  # a training loop that never ends
            time.sleep(0.05)

    @task
    def sft_stage():
        return recorded_stage("sft", {"hangs": True}, {}, ctx, hanging_build).ref

    @flow
    def timed():
        return retrying(RetryConfig(retries=0, timeout_seconds=2))(sft_stage).submit().result()

    started = time.time()
    state = timed(return_state=True)
    assert state.is_failed() and time.time() - started < 30
    assert "timed out" in state.message.lower() or "timeout" in state.message.lower(), state.message
    [worker] = spawned
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert not list((tmp_path / "sft").glob("[0-9a-f]*")), "nothing published"


def test_an_unreachable_mlflow_server_fails_the_run_at_its_start_naming_the_uri(prefect, state, monkeypatch):
    from rlhf_pipeline.tasks.store.resources import free_port
    from tests.flows.helpers import task_states

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    failed = run()
    assert failed.is_failed()
    assert f"MLflow tracking server {uri} cannot be reached" in failed.message
    assert task_states(failed) == {}  # no stage started
    assert not (state / "artifacts").exists()


def test_mlflow_does_not_exist_errors_are_permanent_and_connection_errors_transient():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

    from rlhf_pipeline.tasks.orchestration.stage_task import is_permanent

    assert is_permanent(MlflowException("Run with id=abc not found", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not is_permanent(MlflowException("upstream connect error", error_code=TEMPORARILY_UNAVAILABLE))
    assert not is_permanent(ConnectionError("reset by peer")) and is_permanent(ValueError("bad config"))
