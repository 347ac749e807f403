"""A real Prefect server and `rlhf serve` for the deployment tests, each with its own state folders.

Every process is started here, binds 127.0.0.1 and is stopped by its pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline.deployments.local import stop, wait_until_up
from rlhf_pipeline.tasks.store.resources import free_port
from tests.prefect_db import seeded

ROOT = Path(__file__).resolve().parents[2]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@contextmanager
def running_service(tmp: Path, serve_args: list[str] = ()) -> Iterator[dict]:
    """A Prefect server on a free port and `rlhf serve [serve_args]` against it; both stopped, and checked dead, on
    exit."""
    port, mlflow_ui = free_port(), "http://127.0.0.1:9"  # no MLflow UI runs: links are only written
    env = {
        **os.environ,
        "PREFECT_HOME": seeded(tmp / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "RLHF_STATE_DIR": str(tmp / "state"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
        "RLHF_MLFLOW_UI": mlflow_ui,
        "PREFECT_SERVER_LOG_RETRYABLE_ERRORS": "true",  # a 503's cause (SQLite busy) goes to server.log
    }
    env.pop("PREFECT_LOGGING_EXTRA_LOGGERS", None)  # `rlhf serve` sets it, as for a user
    logs = {name: open(tmp / f"{name}.log", "w") for name in ("server", "serve")}
    processes = []
    try:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=logs["server"],
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        processes.append(server)
        wait_until_up(f"{env['PREFECT_API_URL']}/health", server, timeout=180)
        serve = subprocess.Popen(
            [sys.executable, "-m", "rlhf_pipeline", "serve", *serve_args],
            env=env,
            stdout=logs["serve"],
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        processes.append(serve)
        yield {"env": env, "tmp": tmp, "client": lambda: api_client(env), "processes": processes}
    finally:
        stop(processes)
        for process in processes:
            assert process.poll() is not None, f"pid {process.pid} still running"
        for log in logs.values():
            log.close()


def api_client(env):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(env["PREFECT_API_URL"], auth_string=env.get("PREFECT_API_AUTH_STRING"))


def deployment(service, name: str, timeout: float = 120):
    """Wait until `rlhf serve` has registered the deployment."""
    from prefect.exceptions import ObjectNotFound

    deadline = time.time() + timeout
    while True:
        try:
            with service["client"]() as client:
                return client.read_deployment_by_name(name)
        except ObjectNotFound:
            serve = service["processes"][1]
            assert serve.poll() is None, (service["tmp"] / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, f"{name} was not registered within {timeout}s"
            time.sleep(1)


def wait_for(service, flow_run_id, timeout: float = 900):
    deadline = time.time() + timeout
    with service["client"]() as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state.type.value in FINAL:
                return run
            assert time.time() < deadline, f"flow run {flow_run_id} still {run.state.name} after {timeout}s"
            time.sleep(2)


def explain(service, run) -> str:
    """The run's state now (not as `run` was read), its Prefect log and the serve process's output."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with service["client"]() as client:
        run = client.read_flow_run(run.id)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    return (
        f"{run.state}\n"
        + "\n".join(log.message for log in logs)[-6000:]
        + (service["tmp"] / "serve.log").read_text()[-3000:]
    )


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in found]
