"""Training stages hold a slot of the `rlhf-gpu` concurrency limit: two runs never train on one device at once."""

from __future__ import annotations

import time

import pytest

from rlhf_pipeline.tasks.orchestration.stage_task import device_hold, device_limit, ensure_device_limit
from rlhf_pipeline.tasks.stages import BY_NAME
from rlhf_pipeline.tasks.store.artifacts import RunContext
from rlhf_pipeline.tasks.tracking import client as tracking
from tests.helpers import recorded_stage

pytestmark = pytest.mark.slow  # a pipeline run end to end: the fast loop skips it (-m 'not slow')


def overlaps(spans: list[tuple[float, float]]) -> bool:
    spans = sorted(spans)
    return any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_device_stages_wait_for_each_other_and_data_stages_do_not(prefect, tmp_path):
    from prefect import flow, get_client, task

    ensure_device_limit()
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(device_limit()).limit == 1
    experiment = tracking.experiment_id("device-slot-test")
    ctx = RunContext(
        artifact_root=str(tmp_path),
        experiment_id=experiment,
        parent_run_id=tracking.start_run(experiment, "parent", {}),
    )
    spans: dict[str, list[tuple[float, float]]] = {"sft": [], "data": []}

    def build(stage):
        def run(out_dir, work_dir, log_metrics):
            started = time.time()
            time.sleep(1.0)
            spans[stage].append((started, time.time()))
            (out_dir / "done").write_text(stage)
            return {}

        return run

    @task
    def stage(name: str, run: int):
        return recorded_stage(
            name, {"run": run}, {}, ctx, build(name), hold=device_hold(name, BY_NAME[name].device)
        ).ref

    @flow
    def two_runs_at_once():
        futures = [stage.submit(name, run) for name in ("sft", "data") for run in (1, 2)]
        return [future.result() for future in futures]

    two_runs_at_once()
    assert len(spans["sft"]) == len(spans["data"]) == 2
    assert not overlaps(spans["sft"])
    assert overlaps(spans["data"])  # the control: without a slot they do run side by side


def test_a_stage_waits_for_the_slot_no_longer_than_its_limit_and_the_error_names_who_holds_it(prefect, tmp_path):
    from prefect import flow, task
    from prefect.runtime import flow_run

    ensure_device_limit()
    experiment = tracking.experiment_id("device-slot-test")
    ctx = RunContext(
        artifact_root=str(tmp_path),
        experiment_id=experiment,
        parent_run_id=tracking.start_run(experiment, "parent", {}),
    )
    holding = []

    def build(seconds: float):
        def run(out_dir, work_dir, log_metrics):
            holding.append(time.time())
            time.sleep(seconds)
            (out_dir / "done").write_text("x")
            return {}

        return run

    @task(name="sft")
    def long_sft():
        return recorded_stage("sft", {"run": "holder"}, {}, ctx, build(8), hold=device_hold("sft", True)).ref

    @task(name="rm")
    def impatient_rm():
        deadline = time.time() + 60
        while not holding and time.time() < deadline:  # the sft holds the slot
            time.sleep(0.1)
        return recorded_stage(
            "rm", {"run": "waiter"}, {}, ctx, build(0), hold=device_hold("rm", True, wait_seconds=2)
        ).ref

    @flow(name="busy-device")
    def busy_device():
        held, waited = long_sft.submit(), impatient_rm.submit()
        return held.result(), waited.result(raise_on_failure=False), flow_run.name

    started = time.time()
    held, waited, name = busy_device()
    assert isinstance(waited, TimeoutError), waited
    message = str(waited)
    assert f"rm: no slot of concurrency limit {device_limit()!r} within 2s" in message, message
    assert "held by sft-" in message and f"of flow run {name!r}, running since" in message, message
    assert (held.path / "done").is_file()  # the holder finished its stage
    assert time.time() - started < 30
