"""A stage's trainer as a Ray Train job: the driver `tasks.orchestration.launcher` starts for `launch.launcher: ray`.

    python -m rlhf_pipeline.trainers.runtime.ray_job <work_dir>/launch.json --workers N --resources '{"CPU": 1}' \
        --strategy PACK [--address ADDRESS]

This process is the job's driver. It joins the Ray cluster at `--address` (else `RAY_ADDRESS`; a Ray Client head that
refuses it is asked again, `join`), or starts a local one on 127.0.0.1 that ends with it, checks that the cluster can
hold the workers, and fits a Ray Train `TorchTrainer` of N workers. Ray places them, sets up their torch process group
(gloo on CPUs, NCCL on GPUs) and torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR), so every worker runs
`trainers.runtime.rank.run_spec` exactly as an accelerate rank does: rank 0 saves into the stage's out_dir and every
rank checkpoints into, and resumes from, the same work_dir (the state folder is on storage every node mounts).

Rank 0's metrics, progress records and log lines, every rank's warnings, and each worker's place (node and rank) reach
this process through a Ray queue and leave on stdout as the lines `trainers.runtime.rank` prints, so the parent reads
both launchers alike. Ray retries nothing (`FailureConfig(max_failures=0)`): a worker that dies fails the fit, this
process exits non-zero, and the stage's Prefect task retries, resuming from the newest complete checkpoint. An error no
retry can fix (`trainers.runtime.failures.PERMANENT`) is written to `<work_dir>/launch-error.json`, rank 0's final
metrics to `<work_dir>/result.json`. When this process ends, by any signal, the cluster ends the job's actors (the Train
controller and every worker); a local cluster ends with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from rlhf_pipeline.trainers.runtime.failures import PERMANENT
from rlhf_pipeline.trainers.runtime.rank import (
    ERROR_FILE,
    METRICS_MARK,
    PROGRESS_MARK,
    RESULT_FILE,
    die_with_parent,
    permanent_error,
    run_spec,
)

FORWARDED = ("RLHF_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "NLTK_", "TQDM_", "PYTHONHASHSEED")
"""The driver's environment variables every worker gets (the stage, secrets by `SECRETS_ENV`, the model cache, the
hub's offline switch, the operator's allow-lists): a worker on another machine inherits nothing from this process."""

PLACED = "ray worker "
"""The line each worker sends first: `ray worker <rank>/<world> on node <node id> (<ip>)`."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_pipeline.trainers.runtime.ray_job")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--resources", type=json.loads, required=True)
    parser.add_argument("--strategy", default="PACK")
    parser.add_argument("--address", default=None)
    args = parser.parse_args(argv)
    die_with_parent()
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    work_dir = args.spec.parent
    stage = os.environ.get("RLHF_STAGE", "stage")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home from a training job
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if not address:  # Ray's servers on the loopback interface only (docs/LIBRARY-FACTS.md, Ray)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

    import ray

    if address:
        problem = unreachable(address)
        if problem is not None:
            message, permanent = problem
            message = f"the Ray cluster at {address} cannot be joined: {message}"
            if permanent:
                (work_dir / ERROR_FILE).write_text(json.dumps({"rank": None, "type": "ValueError", "message": message}))
            print(message, flush=True)
            return 2
        join(address, stage)
    else:  # a cluster of this machine alone, on the loopback interface; its processes end with this one
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    where = address or "a local cluster (127.0.0.1)"
    refused = too_small(ray.nodes(), args.workers, args.resources, args.strategy)
    if refused:
        message = f"the Ray cluster at {where} cannot hold the stage's workers: {refused}"
        (work_dir / ERROR_FILE).write_text(json.dumps({"rank": None, "type": "ValueError", "message": message}))
        print(message, flush=True)
        return 2
    print(
        f"{stage}: {describe(ray.nodes(), where)}; {args.workers} workers x {shown(args.resources)} ({args.strategy})"
    )
    return _fit(args, work_dir, stage)


def join(address: str, stage: str, tries: int = 3, pause: float = 2.0) -> None:
    """`ray.init(address)`, asked again (up to `tries` in all) when a Ray Client head (`ray://`) answers that the
    server it starts for each driver failed to start: on a loaded head that server now and then exits within half a
    second of its start, before its first log line ("Starting Ray client server failed"), and the next one starts."""
    import ray

    for attempt in range(1, tries + 1):
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            return
        except ConnectionAbortedError as exc:  # Ray Client's "Initialization failure from server"
            if attempt == tries or not address.startswith("ray://"):
                raise
            said = str(exc).strip().splitlines()[-1]
            print(f"{stage}: the Ray cluster at {address} refused this driver ({said}); joining again", flush=True)
            time.sleep(pause * attempt)


def _fit(args: argparse.Namespace, work_dir: Path, stage: str) -> int:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    lines: Queue = Queue(actor_options={"num_cpus": 0})
    results: dict[str, Any] = {}
    done = threading.Event()

    def drain() -> None:
        while True:
            try:
                kind, value = lines.get(timeout=0.5)
            except Exception:  # empty (ray.util.queue.Empty) or the queue gone with the job
                if done.is_set():
                    return
                continue
            if kind == "result":
                results["metrics"] = value
            else:
                print(value, flush=True)

    printer = threading.Thread(target=drain, name="ray-lines", daemon=True)
    printer.start()
    gpus = args.resources.get("GPU", 0) > 0
    trainer = TorchTrainer(
        _work,
        train_loop_config={
            "spec": str(args.spec),
            "queue": lines,
            "env": {name: value for name, value in os.environ.items() if name.startswith(FORWARDED)},
            "path": [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))],
        },
        scaling_config=ScalingConfig(
            num_workers=args.workers,
            use_gpu=gpus,
            resources_per_worker=args.resources,
            placement_strategy=args.strategy,
        ),
        run_config=RunConfig(
            name=f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str(work_dir / "ray"),
            failure_config=FailureConfig(max_failures=0),  # the Prefect task retries, from our checkpoints
        ),
    )
    try:
        trainer.fit()
    except Exception as exc:
        failures = getattr(exc, "worker_failures", None) or {}
        permanent = [(rank, error) for rank, error in sorted(failures.items()) if isinstance(error, PERMANENT)]
        if permanent:
            rank, error = permanent[0]
            (work_dir / ERROR_FILE).write_text(json.dumps(permanent_error(error, rank)))
        _finish(lines, done, printer)
        for rank, error in sorted(failures.items()):
            print(f"rank {rank} failed: {''.join(traceback.format_exception_only(error)).strip()}", flush=True)
        if not failures:
            print("".join(traceback.format_exception_only(exc)).strip(), flush=True)
        return 1
    _finish(lines, done, printer)
    (work_dir / RESULT_FILE).write_text(json.dumps(results["metrics"]))
    return 0


def _finish(lines, done: threading.Event, printer: threading.Thread) -> None:
    """Every line the workers sent printed, then the queue's actor ended."""
    import ray

    done.set()
    printer.join(timeout=30)
    ray.kill(lines.actor)


REACH_SECONDS = 10
"""How long a cluster's address gets to accept a connection: `ray.init` waits without end for one that does not
answer."""


def unreachable(address: str) -> tuple[str, bool] | None:
    """Why a driver on this machine cannot join the cluster at `address`, and whether that is for good (a
    parameter to change, not a network to wait for); None when it can try. Ray 2.60 joins a driver through a GCS
    address (host:port) only on one of the cluster's nodes: elsewhere it looks for a raylet on this host for 60 s, then
    fails; Ray Client (`ray://<head>:10001`) works from anywhere."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=REACH_SECONDS).close()
        except OSError as exc:
            return f"{host}:{port} does not answer ({exc})", False
    if not address.startswith("ray://"):
        from ray._private.services import find_node_ids

        if not find_node_ids():
            return (
                "no Ray node runs on this machine, and a driver joins a cluster through host:port only on one of its "
                f"nodes: join it first (ray start --address {address} --num-cpus 0 --num-gpus 0) or give its Ray "
                "Client address, ray://<head>:10001",
                True,
            )
    return None


def too_small(nodes: list[dict], workers: int, resources: dict[str, float], strategy: str) -> str | None:
    """Why a cluster of these nodes (`ray.nodes()`) cannot place `workers` workers of `resources` each, or None. Counts
    what the nodes have, not what is free: workers wait for resources busy with other jobs."""
    alive = [node["Resources"] for node in nodes if node.get("Alive")]
    asked = {name: amount for name, amount in resources.items() if amount > 0}
    holds = [
        min((int(node.get(name, 0) // amount) for name, amount in asked.items()), default=workers) for node in alive
    ]
    if strategy == "STRICT_SPREAD" and sum(1 for n in holds if n) < workers:
        return (
            f"placement_strategy STRICT_SPREAD puts each of {workers} workers on a node of its own; it has "
            f"{sum(1 for n in holds if n)} that can hold one"
        )
    fits = sum(holds)
    if fits < workers:
        total = {name: sum(node.get(name, 0) for node in alive) for name in resources}
        return (
            f"launch.num_workers={workers} x launch.resources_per_worker={shown(resources)}, and its {len(alive)} "
            f"node(s) hold {fits} such worker(s) ({', '.join(f'{n:g} {name}' for name, n in total.items())} in all)"
        )
    return None


def shown(resources: dict[str, float]) -> str:
    """`{CPU: 1, GPU: 1}`: a resource request as the parameters spell it."""
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"


def describe(nodes: list[dict], where: str) -> str:
    """`Ray cluster at <where>: 2 nodes, 4 CPUs, 0 GPUs`."""
    alive = [node["Resources"] for node in nodes if node.get("Alive")]
    cpus = sum(node.get("CPU", 0) for node in alive)
    gpus = sum(node.get("GPU", 0) for node in alive)
    return f"Ray cluster at {where}: {len(alive)} node(s), {cpus:g} CPUs, {gpus:g} GPUs"


def _work(config: dict[str, Any]) -> None:
    """One Ray Train worker: the trainer of `launch.json` in the process group Ray set up."""
    import ray
    import ray.train

    os.environ.update(config["env"])
    sys.path.extend(entry for entry in config["path"] if entry not in sys.path and Path(entry).is_dir())
    lines = config["queue"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    lines.put(("line", f"{PLACED}{rank}/{world} on node {node[:12]} ({ray.util.get_node_ip_address()})"))
    _send_logs(lines, rank)

    def log_metrics(values: dict[str, float], step: int) -> None:
        if rank == 0:
            lines.put(("line", METRICS_MARK + json.dumps({"step": step, "values": values})))

    metrics = run_spec(Path(config["spec"]), log_metrics)
    if rank == 0:
        lines.put(("result", metrics))


class _ToQueue(logging.Handler):
    """Log records as the driver's lines: progress records as `@@rlhf-progress`, others as their message (a rank
    other than 0 names itself)."""

    def __init__(self, lines, rank: int):
        super().__init__()
        self.lines, self.rank = lines, rank

    def emit(self, record: logging.LogRecord) -> None:
        try:
            progress = record.__dict__.get("progress")
            if progress is not None:
                line = PROGRESS_MARK + json.dumps({"message": record.getMessage(), "progress": progress})
            else:
                line = record.getMessage() if self.rank == 0 else f"rank {self.rank}: {record.getMessage()}"
            self.lines.put(("line", line))
        except Exception:
            self.handleError(record)


def _send_logs(lines, rank: int) -> None:
    """Rank 0's `rlhf_pipeline` records (progress included) and every rank's warnings into the driver's queue."""
    from rlhf_pipeline.trainers.runtime.progress import PROGRESS, TICKS

    handler = _ToQueue(lines, rank)
    handler.setLevel(logging.NOTSET if rank == 0 else logging.WARNING)
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    root.addHandler(handler)
    logging.captureWarnings(True)
    logging.getLogger("rlhf_pipeline").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if rank == 0:
        PROGRESS.propagate = False  # the parent logs the line once, from the record it rebuilds
        for logger in (PROGRESS, TICKS):
            logger.addHandler(handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
