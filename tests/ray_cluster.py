"""A real Ray cluster of two nodes on this host, started and stopped by the tests: a head node and a second node that
joins it, each a `ray start --block` process of its own (its own session, stopped by its process group id) with one
CPU, on loopback addresses of their own (127.0.0.2, 127.0.0.3: Ray takes 127.0.0.1 for "this machine" and refuses a
second node there). Ray's servers listen on every interface in a cluster of several nodes (Ray 2.60 has no switch for
it); the cluster takes only drivers and nodes holding its token (`RAY_AUTH_MODE=token`). No node runs Ray's log monitor,
which pushes every worker's output to drivers that ask for it (`log_to_driver`): the job's driver does not
(`trainers/runtime/ray_job.py`; its workers' lines come through a Ray queue), and the two monitors polled their logs
for the whole module (~50 CPU s each in the suite of 7477bae, on one host where Ray wants one at most)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rlhf_pipeline.tasks.store.resources import free_port

HEAD, SECOND = "127.0.0.2", "127.0.0.3"
NODES: dict[str, list[int]] = {}
"""The `ray start` processes (one per node) of each cluster started here, by its address."""
CLIENT = "RLHF_TEST_RAY_CLIENT"
"""The head's Ray Client address (`ray://...`), for a driver on a machine that runs no node of the cluster."""


def _start(arguments: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    ray = Path(sys.executable).with_name("ray")
    command = [str(ray), "start", "--block", "--num-cpus", "1", "--num-gpus", "0", "--include-log-monitor", "false"]
    return subprocess.Popen(
        [*command, *arguments],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def _stop(processes: list[subprocess.Popen], timeout: float = 2) -> None:
    """SIGTERM to each node's process group (`ray start` and the servers and workers under it), all at once, and
    SIGKILL to what is left after `timeout`: a second node's processes end in ~1 s, a head's take ~30 s, so waiting
    longer for the head only idles the test."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.time() + timeout
    for process in processes:
        while time.time() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            process.poll()
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def alive_nodes(address: str, env: dict[str, str]) -> int:
    """How many nodes the cluster at `address` has alive, as a driver sees it."""
    probe = "import ray; ray.init(address=%r, log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
    answer = subprocess.run(
        [sys.executable, "-c", probe % address], capture_output=True, text=True, env=env, timeout=120
    )
    return int(answer.stdout.strip() or 0)


@contextlib.contextmanager
def two_nodes(timeout: float = 120) -> Iterator[dict[str, str]]:
    """The cluster, up with both nodes; yields the environment a driver needs (`RAY_ADDRESS` and the token)."""
    folder = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    port, client = free_port(), free_port()
    env = {
        **os.environ,
        "RAY_ADDRESS": f"{HEAD}:{port}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    head = _start(
        ["--head", "--node-ip-address", HEAD, "--port", str(port), "--ray-client-server-port", str(client)]
        + ["--include-dashboard", "false"]
        + ["--temp-dir", str(folder / "head")],
        folder / "head.log",
        env,
    )
    nodes = [head]
    try:
        deadline = time.time() + timeout
        # The head's GCS port first (a probe of its nodes would import Ray in a new process each time); the second
        # node waits for the GCS itself.
        while not _listening(HEAD, port):
            assert head.poll() is None and time.time() < deadline, (folder / "head.log").read_text()[-3000:]
            time.sleep(0.2)
        nodes.append(_start(["--address", env["RAY_ADDRESS"], "--node-ip-address", SECOND], folder / "node.log", env))
        # `ray start` says so once its node has registered; then a driver's view confirms both nodes alive.
        while "Ray runtime started" not in (folder / "node.log").read_text(errors="replace"):
            assert nodes[1].poll() is None and time.time() < deadline, (folder / "node.log").read_text()[-3000:]
            time.sleep(0.2)
        while alive_nodes(env["RAY_ADDRESS"], env) < 2:
            assert nodes[1].poll() is None and time.time() < deadline, (folder / "node.log").read_text()[-3000:]
            time.sleep(1)
        NODES[env["RAY_ADDRESS"]] = [node.pid for node in nodes]
        names = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")
        yield {**{name: env[name] for name in names}, CLIENT: f"ray://{HEAD}:{client}"}
    finally:
        NODES.pop(env["RAY_ADDRESS"], None)
        _stop(nodes)
        shutil.rmtree(folder, ignore_errors=True)


def train_workers(address: str | None = None) -> list:
    """Ray Train worker processes on this host (`ray::RayTrainWorker...`): of the cluster at `address` started here
    (descendants of its nodes' `ray start` processes; each worker is a session of its own), or of any cluster
    (another test's, under xdist, included)."""
    import psutil

    nodes = set(NODES.get(address, [])) if address else None
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            named = " ".join(process.info["cmdline"] or []) + (process.info["name"] or "")
            if "RayTrainWorker" in named and (nodes is None or nodes & {p.pid for p in process.parents()}):
                found.append(process)
    return found
