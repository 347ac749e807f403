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
    import importlib.util
    import subprocess

    from rlhf_pipeline.tasks.store.resources import free_port

    port = free_port()
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
    from rlhf_pipeline.trainers.runtime.rank import (
        die_with_parent,  # stdlib only; a killed `rlhf run` leaves no server behind
    )

    # A process group of its own: Ctrl-C, which the terminal sends the whole foreground group, must not stop it before
    # the run has recorded its stop (rlhf_pipeline.interrupt); it is stopped last.
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, process_group=0)
    _TEMPORARY.update(process=process, url=f"http://127.0.0.1:{port}/api")
    os.environ["PREFECT_API_URL"] = _TEMPORARY["url"]
    # Its leases die with it, so device slots are not shared through it (tasks.orchestration.stage_task.coordinated);
    # the name is written out here, since importing tasks.orchestration.stage_task would import Prefect before the
    # server starts.
    os.environ["RLHF_TEMPORARY_PREFECT_API_URL"] = _TEMPORARY["url"]
    atexit.register(stop)  # registered before Prefect's handlers, so it runs after them


def wait() -> None:
    """Wait for the temporary server (said once the parameters are known good: a run refused before it needs the
    server says nothing of it)."""
    import time
    import urllib.error
    import urllib.request

    process = _TEMPORARY.get("process")
    if process is None:
        return
    print(
        f"Starting temporary Prefect server on {_TEMPORARY['url'].removesuffix('/api')} (set PREFECT_API_URL to use "
        "a running one)",
        file=sys.stderr,
    )
    timeout = float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"rlhf: the temporary Prefect server exited with {process.returncode} before it answered (its output "
                "is above)"
            )
        try:
            with urllib.request.urlopen(f"{_TEMPORARY['url']}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"rlhf: the temporary Prefect server did not answer at {_TEMPORARY['url']} within {timeout:.0f}s")


def stop() -> None:
    """Stop the temporary server, if one was started, and stop naming it in the environment."""
    import subprocess

    url = _TEMPORARY.pop("url", None)
    for name in ("PREFECT_API_URL", "RLHF_TEMPORARY_PREFECT_API_URL"):
        if url is not None and os.environ.get(name) == url:
            del os.environ[name]
    process = _TEMPORARY.pop("process", None)
    if process is not None and process.poll() is None:
        process.terminate()  # the last logs are sent (`_report`); uvicorn finishes its shutdown on its own
        try:
            process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
