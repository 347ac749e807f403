"""The flows' task runner (`stage_task.stage_runner`): one thread for every task of a run, and a task that takes the
step before it as a parameter is a node of its own in the Prefect UI's graph, however late the server records that
step's end."""

from __future__ import annotations

import threading

import pytest
from prefect import flow, task
from prefect.client.schemas.objects import StateDetails
from prefect.states import Running

from rlhf_pipeline.tasks.orchestration.stage_task import stage_runner

pytestmark = pytest.mark.slow  # the session's Prefect test server


@task
def step(upstream: list[int] | None = None) -> list[int]:
    return [*(upstream or []), threading.get_ident()]


@flow(task_runner=stage_runner())
def two_steps() -> dict:
    first = step.submit()
    second = step.submit(first, wait_for=[first])  # a future as a parameter, as the registry takes eval's report
    # (no `first.result()` here: the flow's own wait would keep first's final state before second starts)
    return {"threads": second.result(), "second": second.task_run_id}


def test_every_task_runs_on_one_thread_and_a_finished_upstream_is_not_read_as_a_running_parent(prefect, monkeypatch):
    import prefect.futures
    from prefect import get_client

    # The server records a task's end a moment after it: read every state without a local one as still running.
    original = prefect.futures.PrefectTaskRunFuture.state

    def still_running(future):
        return future._final_state or Running(state_details=StateDetails(task_run_id=future.task_run_id))

    monkeypatch.setattr(prefect.futures.PrefectTaskRunFuture, "state", property(still_running))
    ran = two_steps()
    monkeypatch.setattr(prefect.futures.PrefectTaskRunFuture, "state", original)
    assert len(ran["threads"]) == 2 and len(set(ran["threads"])) == 1  # the one worker thread
    with get_client(sync_client=True) as client:
        inputs = client.read_task_run(ran["second"]).task_inputs
    assert "__parents__" not in inputs, inputs  # Prefect would draw it inside the first step's group
