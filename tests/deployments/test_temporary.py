"""The temporary Prefect server of `rlhf run` and `rlhf eval`: a batch task, whose wake-ups do not preempt a run's
compute threads (bench.server_beside), stopped without waiting for its exit and never outliving the command."""

from __future__ import annotations

import os
import signal

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
    assert process.wait(timeout=30) == -signal.SIGTERM  # stop() does not wait, and the server does not outlive it


def test_a_refused_run_starts_no_server_and_leaves_no_process_behind(tmp_path):
    """`rlhf run` refused (the dataset the parameters name is missing) starts no temporary server: the server comes up
    once the parameters hold (before, it started beside their loading and was stopped for nothing). Every process the
    command starts inherits a marker in its environment, which finds them."""
    import subprocess
    import sys
    import time
    import uuid

    marker = f"rlhf-test-{uuid.uuid4().hex}"
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    missing = tmp_path / "no-such-sft.jsonl"
    command = [sys.executable, "-m", "rlhf_pipeline", "run", "--set", f"data.sft.path={missing}"]
    run = subprocess.Popen(
        command, env={**env, "RLHF_TEST_MARKER": marker}, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    servers = set()
    while run.poll() is None:  # the server it started, seen while the command runs
        servers.update(pid for pid, command in marked(marker).items() if "prefect_app:create_app" in command)
        time.sleep(0.05)
    stderr = run.stderr.read()
    assert run.returncode == 2 and f"data.sft.path: {missing}" in stderr, stderr
    assert not servers, "a refused command started a temporary server"
    deadline = time.monotonic() + 30
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not marked(marker)


def marked(marker: str) -> dict[int, str]:
    """The processes whose environment holds `marker`: pid -> command line."""
    import psutil

    return {
        process.pid: " ".join(process.info["cmdline"] or ())
        for process in psutil.process_iter(["environ", "cmdline"])
        if (process.info["environ"] or {}).get("RLHF_TEST_MARKER") == marker
    }
