"""What MLflow's job runner costs an idle `mlflow server`: CPU seconds in its first minute, with the runner (MLflow's
default) and without (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`, as `rlhf up` and the tests start theirs).

    python -m bench.mlflow_jobs                # ~4 minutes: 2 rounds, each one server either way, interleaved
    python -m bench.mlflow_jobs --rounds 3 --seconds 60

Each server runs on a fresh SQLite store with one worker on 127.0.0.1, as `tests/mlflow_server.py` starts it, and is
watched for `--seconds` from its start: the CPU time of the server and of every process under it, read every 0.5 s
(each process's last reading counts). Verdict: without the runner, every round costs less CPU than the same round
with it; exit 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf_pipeline.deployments.local import MLFLOW_NO_JOBS
from rlhf_pipeline.tasks.store.resources import free_port


def idle_server(jobs: bool, seconds: float) -> tuple[float, int, float | None]:
    """One server watched for `seconds`: (CPU seconds of its processes, how many there were, seconds until it
    answered)."""
    import psutil

    store = Path(tempfile.mkdtemp(prefix="bench-mlflow-jobs-"))
    port = free_port()
    env = dict(os.environ)
    env.pop("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", None)  # MLflow's default: the runner on
    if not jobs:
        env.update(MLFLOW_NO_JOBS)
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}"]
    command += ["--workers", "1", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        command, env=env, cwd=store, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    started, seen = time.time(), {}
    answered: float | None = None
    try:
        while time.time() - started < seconds:
            if answered is None:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    answered = time.time() - started
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(server.pid)
                for process in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = process.cpu_times()
                        seen[(process.pid, process.create_time())] = times.user + times.system
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        shutil.rmtree(store, ignore_errors=True)
    return sum(seen.values()), len(seen), answered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mlflow_jobs", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(1, args.rounds + 1):
        for jobs in (True, False) if round_ % 2 else (False, True):
            spent, processes, answered = idle_server(jobs, args.seconds)
            reply = "never answering" if answered is None else f"answering after {answered:.1f} s"
            cpu[jobs].append(spent)
            print(
                f"round {round_}, {'with' if jobs else 'without'} the job runner: {spent:.1f} CPU s in "
                f"{args.seconds:.0f} s, {processes} processes, {reply}",
                flush=True,
            )
    less = all(without < with_ for with_, without in zip(cpu[True], cpu[False]))
    print(
        f"median CPU s in the first {args.seconds:.0f} s: with the runner {statistics.median(cpu[True]):.1f}, "
        f"without {statistics.median(cpu[False]):.1f}; without costs less in every round: {'yes' if less else 'no'}"
    )
    return 0 if less else 1


if __name__ == "__main__":
    sys.exit(main())
