"""The temporary Prefect server of `rlhf run` and `rlhf eval` when no PREFECT_API_URL names one: started at once, before
the flow and the libraries import (as Prefect would start it at the flow call: the same uvicorn app and settings as its
SubprocessASGIServer), waited for when the flow needs it, stopped last, after the run has recorded its end
(docs/PERFORMANCE.md, `bench.cache`)."""

from __future__ import annotations

import os
import sys

_TEMPORARY: dict = {}


def start() -> None:
    """With no PREFECT_API_URL, start the temporary Prefect server now, as Prefect would start it at the flow call (the
    same uvicorn app and settings as its SubprocessASGIServer), so that it comes up while this process imports the flow
    and the libraries: Prefect's own way imports its whole server package here first and then waits for the server, ~4 s
    of a cached re-run's ~9 (bench.cache). Stopped at exit, after Prefect's own exit handlers have sent the last
    logs."""
    if os.environ.get("PREFECT_API_URL"):
        return
    import atexit

    from rlhf_pipeline.tasks.store.resources import free_port

    port = free_port()
    process = spawn(port)
    _TEMPORARY.update(process=process, url=f"http://127.0.0.1:{port}/api")
    os.environ["PREFECT_API_URL"] = _TEMPORARY["url"]
    # Its leases die with it, so device slots are not shared through it (tasks.orchestration.stage_task.coordinated);
    # the name is written out here, since importing tasks.orchestration.stage_task would import Prefect before the
    # server starts.
    os.environ["RLHF_TEMPORARY_PREFECT_API_URL"] = _TEMPORARY["url"]
    atexit.register(stop)  # registered before Prefect's handlers, so it runs after them


def spawn(port: int, batch: bool = True):
    """The temporary server's process on `port`: Prefect's uvicorn app with its ephemeral settings, in a process group
    of its own (Ctrl-C, which the terminal sends the whole foreground group, must not stop it before the run has
    recorded its stop: rlhf_pipeline.interrupt; it is stopped last), ending when this process dies, however it dies,
    and a batch task (`batch_task`; `batch=False`: a normal one, which `bench.server_beside` compares)."""
    import importlib.util
    import subprocess

    from rlhf_pipeline.trainers.runtime.rank import die_with_parent  # stdlib only; imported before the fork

    prefect_dir = os.path.dirname(importlib.util.find_spec("prefect").origin)
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        os.path.dirname(prefect_dir),
        "--factory",
        "rlhf_pipeline.deployments.prefect_app:create_app",  # Prefect's, refusing a foreign Host (DNS rebinding)
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]

    def in_server() -> None:
        die_with_parent()
        if batch:
            batch_task()

    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=in_server, process_group=0)


def batch_task() -> None:
    """This process runs as a batch task (Linux SCHED_BATCH), whose wake-ups do not preempt the run's compute
    threads; called in the temporary server before it execs uvicorn. Idle, the server wakes ~100 times a second
    (docket's polls of its in-process Redis, the event services, SQLite's threads); a wake-up that preempts one of
    torch's threads stalls the others at their next barrier, and generation beside the server ran slower (`python -m
    bench.server_beside`, docs/PERFORMANCE.md). A batch task runs when a core is free or at the next scheduler tick, a
    few milliseconds later, at the same share of the cores."""
    if hasattr(os, "SCHED_BATCH"):  # Linux
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def wait() -> None:
    """Wait for the temporary server (said once the parameters are known good: a run refused before it needs the
    server says nothing of it)."""
    process = _TEMPORARY.get("process")
    if process is None:
        return
    print(
        f"Starting temporary Prefect server on {_TEMPORARY['url'].removesuffix('/api')} (set PREFECT_API_URL to use "
        "a running one)",
        file=sys.stderr,
    )
    answered(process, _TEMPORARY["url"], float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))


def answered(process, url: str, timeout: float) -> None:
    """Return once the server `process` started answers at `url` (its API); SystemExit when it exits first or does not
    answer within `timeout` seconds."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"rlhf: the temporary Prefect server exited with {process.returncode} before it answered (its output "
                "is above)"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"rlhf: the temporary Prefect server did not answer at {url} within {timeout:.0f}s")


def stop() -> None:
    """Stop the temporary server, if one was started, and stop naming it in the environment. By then the run has
    recorded its end and sent its last logs (`startup.report`, then Prefect's exit handlers, which run before this
    one), so the server is told to stop and not waited for: uvicorn finishes its shutdown on its own (~0.2 s, which a
    cached re-run would otherwise spend waiting; `bench.cache`), and a second SIGTERM, when this process exits first
    (`die_with_parent`), changes nothing."""
    url = _TEMPORARY.pop("url", None)
    for name in ("PREFECT_API_URL", "RLHF_TEMPORARY_PREFECT_API_URL"):
        if url is not None and os.environ.get(name) == url:
            del os.environ[name]
    process = _TEMPORARY.pop("process", None)
    if process is not None and process.poll() is None:
        process.terminate()
