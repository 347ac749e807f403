"""A real `mlflow server` on a SQLite store, started and stopped by the tests (stopped by its process group id)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rlhf_pipeline.deployments.local import MLFLOW_NO_JOBS


def start(store_uri: str, port: int, pid_file: Path, timeout: float = 120, artifacts: Path | None = None) -> int:
    """Start it (one worker), write its pid to `pid_file`, and return once /health answers. `artifacts`: the folder
    the server keeps artifacts in (it serves them over HTTP); default `mlartifacts` beside `pid_file` (MLflow's own
    default is the working directory's: the checkout, for the suite)."""
    artifacts = artifacts or Path(pid_file).parent / "mlartifacts"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store_uri, "--workers", "1"]
        + ["--host", "127.0.0.1", "--port", str(port), "--artifacts-destination", str(artifacts)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**MLFLOW_NO_JOBS, **os.environ},  # as `rlhf up` starts its own
    )
    Path(pid_file).write_text(f"{server.pid}\n")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server.pid
        except OSError:
            time.sleep(0.5)
    stop(pid_file)
    raise TimeoutError(f"mlflow server on port {port} did not answer in {timeout:.0f}s")


def stop(pid_file: Path, timeout: float = 30) -> None:
    """Stop the server named in `pid_file` and everything it started; return once it is gone."""
    pid = int(Path(pid_file).read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it, when this process started it
        except ChildProcessError:
            pass
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
