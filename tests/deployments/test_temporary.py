"""The temporary Prefect server of `rlhf run` and `rlhf eval`: a batch task, whose wake-ups do not preempt a run's
compute threads (bench.server_beside)."""

from __future__ import annotations

import os

from rlhf_pipeline.deployments import temporary


def policies(pid: int) -> set[int]:
    """The scheduling policy of each thread of process `pid` (threads that end meanwhile left out)."""
    found = set()
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(os.sched_getscheduler(int(thread)))
        except ProcessLookupError:
            pass
    return found


def test_the_temporary_server_answers_with_every_thread_a_batch_task_and_leaves_the_run_as_it_was(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    temporary.start()
    process = temporary._TEMPORARY["process"]
    try:
        temporary.wait()  # it answers: uvicorn, Prefect's services and docket's worker are up
        assert len(os.listdir(f"/proc/{process.pid}/task")) > 1
        assert policies(process.pid) == {os.SCHED_BATCH}
        assert policies(os.getpid()) == {os.SCHED_OTHER}
    finally:
        temporary.stop()
    assert "PREFECT_API_URL" not in os.environ
