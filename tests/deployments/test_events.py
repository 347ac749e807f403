"""Prefect events and hooks against a real Prefect server and `rlhf serve` (tests/deployments/servers.py):
`rlhf.data.updated`, emitted with `prefect event emit`, starts `rlhf/retrain`; a second retrain while one runs waits
or is cancelled, as `--retrain-collision` says; the registry announces `rlhf.model.candidate` and
`rlhf.model.promoted`; a failed or crashed run's hook names its MLflow run and state folder.

Every process is started here, binds 127.0.0.1 and is stopped by its pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf_pipeline.deployments.serve import deployment_version
from tests.deployments.servers import FINAL, ROOT, deployment, explain, running_service, wait_for
from tests.helpers import CI_PRESET

pytestmark = pytest.mark.slow  # a real Prefect server, `rlhf serve` and retrains from events: about a minute each

SERVE = ["--config", CI_PRESET]  # every deployment carries the tests' preset: a retrain takes about a minute
TRIGGER = "rlhf/retrain on rlhf.data.updated"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`rlhf serve` with the default collision strategy (queue); a run waiting for the retrain slot tries again every
    2 s (the server's default: 30 s)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS", "2")
        with running_service(tmp_path_factory.mktemp("events"), SERVE) as service:
            yield service


def emit_data_updated(service, dataset: str = "preference") -> None:
    """What an ingest job or a labelling tool runs when data lands: Prefect's CLI, against this server."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "event",
            "emit",
            "rlhf.data.updated",
            "--resource-id",
            f"rlhf.data.{dataset}",
        ],
        env=service["env"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def wait_for_trigger(service, timeout: float = 60) -> None:
    """Until the served retrain deployment's automation exists."""
    deadline = time.time() + timeout
    with service["client"]() as client:
        while not client.read_automations_by_name(TRIGGER):
            assert time.time() < deadline, f"no automation {TRIGGER!r} after {timeout}s"
            time.sleep(1)


def runs_of(service, deployment_id, count: int, timeout: float = 120) -> list:
    """The deployment's flow runs that an automation (its trigger) created, oldest first, once there are `count` of
    them (its cron schedule has made others, weeks ahead)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    deadline = time.time() + timeout
    with service["client"]() as client:
        while True:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC,
            )
            runs = [run for run in runs if run.created_by and run.created_by.type == "AUTOMATION"]
            if len(runs) >= count:
                return runs
            assert time.time() < deadline, f"{len(runs)} runs of the deployment after {timeout}s, expected {count}"
            time.sleep(1)


def wait_until(service, flow_run_id, state_type: str, timeout: float = 300):
    deadline = time.time() + timeout
    with service["client"]() as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state.type.value == state_type:
                return run
            assert run.state.type.value not in FINAL, explain(service, run)
            assert time.time() < deadline, f"flow run {run.name} still {run.state.name} after {timeout}s"
            time.sleep(0.5)


def parent_run(service, flow_run_id):
    """The MLflow parent run of a flow run (tag `prefect.flow_run_id`), or None."""
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(tracking_uri=service["env"]["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name("rlhf")
    found = experiment and mlflow.search_runs(
        [experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'"
    )
    return found[0] if found else None


def logs(service, flow_run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with service["client"]() as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]


def hook_line(service, flow_run_id, state: str, timeout: float = 60) -> str:
    """The failure/crash hook's line in the run's Prefect log (Prefect ships log lines in batches)."""
    deadline = time.time() + timeout
    while True:
        found = [m for m in logs(service, flow_run_id) if f" {state}: " in m and "state folder" in m]
        if found:
            return found[0]
        assert time.time() < deadline, logs(service, flow_run_id)
        time.sleep(1)


def test_data_event_starts_a_retrain_a_second_one_waits_and_the_registry_announces_the_model(service):
    from prefect.events.filters import EventFilter, EventNameFilter

    retrain = deployment(service, "rlhf/retrain")
    assert retrain.tags == ["rlhf", "ppo", "retrain"] and retrain.version == deployment_version()
    assert retrain.global_concurrency_limit.limit == 1
    assert retrain.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert deployment(service, "rlhf-eval/eval").tags == ["rlhf", "eval"]
    wait_for_trigger(service)

    emit_data_updated(service)
    [first] = runs_of(service, retrain.id, 1)
    first = wait_until(service, first.id, "RUNNING")
    emit_data_updated(service, "prompts")  # more data lands while the first retrain trains
    second = runs_of(service, retrain.id, 2)[1]
    seen = set()
    with service["client"]() as client:
        while client.read_flow_run(first.id).state.type.value == "RUNNING":
            seen.add(client.read_flow_run(second.id).state.name)
            time.sleep(0.5)
    assert "AwaitingConcurrencySlot" in seen and "Running" not in seen, seen
    first, second = wait_for(service, first.id), wait_for(service, second.id)
    assert first.state.type.value == "COMPLETED", explain(service, first)
    assert second.state.type.value == "COMPLETED", explain(service, second)
    assert second.start_time >= first.end_time  # one at a time
    assert first.created_by.type == "AUTOMATION" and first.created_by.display_value == TRIGGER

    # Names that say what runs, on the flow run and on its MLflow parent run; the deployment's tags on the runs.
    # Unnamed (an automation's), each is `<algorithm>-<preset>-<its id's first 6 characters>`: distinguishable.
    assert [run.name for run in (first, second)] == [f"ppo-ci-{str(run.id)[:6]}" for run in (first, second)]
    assert first.name != second.name and {"rlhf", "ppo", "retrain"} <= set(first.tags)
    parents = [parent_run(service, run.id) for run in (first, second)]
    assert [parent.info.run_name for parent in parents] == [first.name, second.name]

    # The registry's events: the first policy became candidate and champion; the second run's policy is the same
    # version (the same bytes), candidate again and already champion: nothing was promoted.
    with service["client"]() as client:
        deadline = time.time() + 30
        while True:
            page = client.read_events(EventFilter(event=EventNameFilter(prefix=["rlhf.model."])), limit=50)
            events = sorted(page.events, key=lambda event: event.occurred)
            if len(events) >= 3 or time.time() > deadline:
                break
            time.sleep(1)
    assert [event.event for event in events] == ["rlhf.model.candidate", "rlhf.model.promoted", "rlhf.model.candidate"]
    candidate, promoted, again = events
    assert promoted.resource.id == "mlflow.model.rlhf-policy"
    assert (promoted.resource["version"], promoted.resource["alias"]) == ("1", "champion")
    assert (candidate.resource["version"], candidate.resource["alias"]) == ("1", "candidate")
    assert promoted.payload["mlflow_run_id"] == parents[0].info.run_id
    assert promoted.payload["reason"] == "no champion yet: the first version becomes champion"
    # No champion to compare with the first time, and the champion itself the second: the gate metric went unmeasured
    # (tests/tasks/orchestration/test_events.py checks the metrics a measured gate sends).
    gate = promoted.payload["gate_metric"]
    assert gate.startswith("eval/heldout/") and gate not in parents[0].data.metrics | parents[1].data.metrics
    assert promoted.payload["metrics"] == again.payload["metrics"] == {}
    assert again.payload["reason"] == "already champion" and again.payload["mlflow_run_id"] == parents[1].info.run_id
    related = {resource.id for resource in promoted.related}
    assert f"prefect.flow-run.{first.id}" in related and f"prefect.deployment.{retrain.id}" in related


def test_a_failed_runs_hook_names_its_mlflow_run_and_state_folder(service):
    full = deployment(service, "rlhf/full")
    with service["client"]() as client:
        run = client.create_flow_run_from_deployment(
            full.id, parameters={"retry": {"retries": 0}, "data": {"preference": {"path": "/no/such/prefs.jsonl"}}}
        )
    run = wait_for(service, run.id)
    assert run.state.type.value == "FAILED", explain(service, run)
    parent = parent_run(service, run.id)
    line = hook_line(service, run.id, "Failed")
    state = service["tmp"] / "state"
    assert f"MLflow parent run {parent.info.run_id}: " in line and f"state folder {state} " in line, line
    assert line.startswith(f"rlhf run 'ppo-ci-{str(run.id)[:6]}' Failed"), line
    assert line in (service["tmp"] / "serve.log").read_text()  # printed too: the serve process's output


def test_cancel_collision_cancels_a_second_retrain_and_a_crashed_runs_hook_names_its_mlflow_run(tmp_path):
    import psutil

    with running_service(tmp_path, [*SERVE, "--retrain-collision", "cancel"]) as service:
        retrain = deployment(service, "rlhf/retrain")
        assert retrain.concurrency_options.collision_strategy.value == "CANCEL_NEW"
        wait_for_trigger(service)
        emit_data_updated(service)
        [first] = runs_of(service, retrain.id, 1)
        wait_until(service, first.id, "RUNNING")
        deadline = time.time() + 120
        while parent_run(service, first.id) is None:  # the flow has opened its MLflow run
            assert time.time() < deadline, explain(service, first)
            wait_until(service, first.id, "RUNNING")  # fails at once when the run has ended
            time.sleep(0.5)
        emit_data_updated(service)
        second = wait_for(service, runs_of(service, retrain.id, 2)[1].id, timeout=120)
        assert second.state.type.value == "CANCELLED", explain(service, second)
        assert second.state.message == "Deployment concurrency limit reached."

        # The first retrain's process dies (the machine ran out of memory, say): Prefect marks it crashed and the
        # serve process runs the crash hook.
        [process] = [
            child
            for child in psutil.Process(service["processes"][1].pid).children()
            if child.environ().get("PREFECT__FLOW_RUN_ID") == str(first.id)
        ]
        os.kill(process.pid, signal.SIGKILL)
        crashed = wait_for(service, first.id, timeout=120)
        assert crashed.state.type.value == "CRASHED", explain(service, crashed)
        parent = parent_run(service, first.id)
        line = hook_line(service, first.id, "Crashed")
        assert f"MLflow parent run {parent.info.run_id}: " in line and f"state folder {tmp_path / 'state'} " in line
        deadline = time.time() + 30
        while parent_run(service, first.id).info.status == "RUNNING":  # the hook closed it
            assert time.time() < deadline, line
            time.sleep(1)
        assert parent_run(service, first.id).info.status == "FAILED"
