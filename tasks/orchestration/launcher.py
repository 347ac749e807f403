"""Where a training stage runs: in the flow run's own process, or in processes of its own under `accelerate launch`.

    accelerate launch [--config_file deployments/accelerate/<engine>.yaml | --multi_gpu (CPU: gloo)] --num_processes N \
        -m rlhf_pipeline.trainers.runtime.rank <work_dir>/launch.json

The parent (this module, in the Prefect task) writes the stage's resolved arguments to `launch.json`, starts the
launcher in the flow run's process group, streams every line into the task's log, forwards rank 0's metrics to
`log_metrics`, and kills every process of the launch on timeout, cancellation, a failed rank or any error of its own.
Rank 0 saves the model into the stage's temporary directory; the parent then publishes it and writes the manifest
exactly as for an in-process build (`tasks.store.stage.run_stage`). A retry resumes from the newest complete checkpoint
in the work directory, which every attempt shares.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable

from rlhf_pipeline.tasks.config import ENGINE_DIR, ENGINES, LaunchConfig, Launcher
from rlhf_pipeline.tasks.store.resources import free_port
from rlhf_pipeline.tasks.store.secrets import redact
from rlhf_pipeline.trainers.runtime.failures import PERMANENT
from rlhf_pipeline.trainers.runtime.heartbeat import Stalled
from rlhf_pipeline.trainers.runtime.progress import emit
from rlhf_pipeline.trainers.runtime.rank import (
    ERROR_FILE,
    METRICS_MARK,
    PROGRESS_MARK,
    RESULT_FILE,
    SECRETS_ENV,
    die_with_parent,
    write_spec,
)
from rlhf_pipeline.trainers.runtime.stopping import TERMINATING, Terminated

PERMANENT_BY_NAME = {cls.__name__: cls for cls in PERMANENT}
"""Errors a rank reports that no retry can fix (bad config or data): raised again in the parent as the same type."""


RANK_MODULE = "rlhf_pipeline.trainers.runtime.rank"  # what each launched rank runs


def launch_command(launch: LaunchConfig, spec: Path, launcher: Launcher = "accelerate") -> list[str]:
    """The command that runs the stage's ranks: `accelerate launch` on this machine (CPU: gloo DDP over
    `num_processes` processes), or the Ray Train job's driver (`trainers.runtime.ray_job`)."""
    if launcher == "ray":
        ray = [sys.executable, "-m", "rlhf_pipeline.trainers.runtime.ray_job", str(spec)]
        ray += ["--workers", str(launch.num_workers), "--resources", json.dumps(launch.resources_per_worker)]
        ray += ["--strategy", launch.placement_strategy]
        return ray + (["--address", launch.ray_address] if launch.ray_address else [])
    import torch

    cuda = torch.cuda.is_available()
    processes = launch.num_processes or (torch.cuda.device_count() if cuda else 1)
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if cuda:
        config = ENGINE_DIR / f"{launch.engine}.yaml" if launch.engine in ENGINES else Path(launch.engine).expanduser()
        command += ["--config_file", str(config)]
    else:
        # A MULTI_CPU config takes accelerate's simple launcher (one process); --multi_gpu with use_cpu inside gives
        # gloo DDP (docs/LIBRARY-FACTS.md, accelerate).
        command += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--num_processes", str(processes), "--num_machines", "1", "--main_process_port", str(free_port())]
    return [*command, "-m", RANK_MODULE, str(spec)]


def run_launched(
    stage: str,
    trainer: str,
    arguments: dict[str, Any],
    work_dir: Path,
    log_metrics: Callable[[dict[str, float], int], None],
    log: Callable[[str], None],
    launch: LaunchConfig,
) -> dict[str, float]:
    """Run `trainer.train(**arguments)` under `accelerate launch` or as a Ray Train job (`launch.launcher_of(stage)`);
    its final metrics, as the in-process call returns them."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = work_dir / "launch.json"
    for stale in (work_dir / RESULT_FILE, work_dir / ERROR_FILE):
        stale.unlink(missing_ok=True)
    hidden = write_spec(spec, trainer, arguments, mask=redact)  # secrets reach the ranks by environment, not file
    launcher = launch.launcher_of(stage)
    command = launch_command(launch, spec, launcher)
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", "RLHF_STAGE": stage}
    env[LAUNCH_ENV] = uuid.uuid4().hex
    if hidden:
        env[SECRETS_ENV] = json.dumps(hidden)
    log(f"{stage}: {' '.join(command[2:])}")
    # In the flow run's process group, so that a runner cancelling the run (SIGTERM to the group) reaches every rank.
    # Ctrl-C, which the terminal sends the whole group, is the flow run's alone: it sends the ranks SIGTERM (`_stream`).
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        preexec_fn=_rank_start,
    )
    ranks = ProcessTree(process.pid, env[LAUNCH_ENV])
    tail: deque[str] = deque(maxlen=30)
    try:
        _stream(process, ranks, log, log_metrics, tail)
        returncode = process.wait()
    except BaseException as exc:
        if isinstance(exc, Stalled):  # every rank writes its threads' stacks (`trainers.runtime.rank`) into the log
            ranks.signal(signal.SIGUSR1, only=RANK_MODULE)  # the launcher itself would die of it
            time.sleep(1.0)
            for stacks in sorted(work_dir.glob("stacks-rank*.txt")):
                log(f"{stage}: {stacks.stem.removeprefix('stacks-')}'s threads:\n{stacks.read_text(errors='replace')}")
        ranks.kill(launch.kill_grace_seconds, log, stage)
        raise
    finally:
        if process.stdout is not None:
            process.stdout.close()
    ranks.kill(launch.kill_grace_seconds, log, stage)  # ranks the launcher left behind, if any
    error = work_dir / ERROR_FILE
    if error.is_file():
        reported = json.loads(error.read_text())
        where = f"{stage} (rank {reported['rank']})" if reported["rank"] is not None else stage
        raise PERMANENT_BY_NAME.get(reported["type"], RuntimeError)(f"{where}: {reported['message']}")
    if returncode != 0 and TERMINATING.is_set():
        raise Terminated(f"{stage}: the ranks stopped on SIGTERM; the next attempt resumes from their checkpoint")
    if returncode != 0:
        last = "\n".join(tail)
        what = "accelerate launch" if launcher == "accelerate" else "the Ray job"
        raise RuntimeError(
            f"{stage}: {what} exited with {returncode} (a rank failed or was killed); its last lines:\n{last}"
        )
    return json.loads((work_dir / RESULT_FILE).read_text())


def _rank_start() -> None:
    """In the launch's process, before it execs: it dies with the flow run, and ignores Ctrl-C (inherited by the ranks;
    Python keeps an ignored SIGINT ignored)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


LAUNCH_ENV = "RLHF_LAUNCH"
"""A fresh id in the environment of every process of one launch (each inherits it): finds one that left the tree, such
as a worker a local Ray cluster's raylet started as it stopped, whose parent died before the launch was killed."""


class ProcessTree:
    """The launcher and every process under it, remembered as they appear: a rank whose parent died is still found."""

    def __init__(self, pid: int, marker: str = ""):
        import psutil

        self.root = psutil.Process(pid)
        self.known = {self.root}
        self.marker = marker

    def refresh(self) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            self.known |= set(self.root.children(recursive=True))

    def _marked(self) -> set:
        """Every process of this machine whose environment carries this launch's marker."""
        import psutil

        found: set = set()
        if not self.marker:
            return found
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get(LAUNCH_ENV) == self.marker:
                    found.add(process)
        return found

    def _alive(self) -> list:
        import psutil

        alive = []
        for process in self.known:
            with contextlib.suppress(psutil.Error):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
        return alive

    def signal(self, signum: int, only: str = "") -> None:
        """`signum` to every process of the tree that is still running (`only`: those whose command line holds it)."""
        import psutil

        self.refresh()
        for process in self.known:
            with contextlib.suppress(psutil.Error):
                if not only or any(only in part for part in process.cmdline()):
                    process.send_signal(signum)

    def kill(self, grace: float, log: Callable[[str], None], stage: str) -> None:
        """SIGTERM to every process of the launch, then SIGKILL to those alive after `grace` seconds; again for any
        that appeared meanwhile (one a dying process started), until none is left."""
        import psutil

        killed = 0
        for _ in range(5):
            self.refresh()
            self.known |= self._marked()
            alive = self._alive()
            if not alive:
                break
            for process in alive:
                with contextlib.suppress(psutil.Error):
                    process.terminate()
            _, left = psutil.wait_procs(alive, timeout=grace)
            for process in left:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            killed += len(left)
            psutil.wait_procs(left, timeout=5)
        if killed:
            log(f"{stage}: killed {killed} process(es) of the launch that outlived SIGTERM by {grace:.0f}s")


def _stream(process: subprocess.Popen, ranks: ProcessTree, log, log_metrics, tail: deque) -> None:
    """Every line of the ranks into the log, metrics lines into `log_metrics`. Polls, so that a Prefect timeout or
    cancellation raised into this thread is seen between lines, and ends when the flow run's main thread has ended."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    checked, forwarded = 0.0, False
    while True:
        if TERMINATING.is_set() and not forwarded:  # SIGTERM reached the flow run: the ranks checkpoint and stop too
            ranks.signal(signal.SIGTERM)
            forwarded = True
        if time.monotonic() - checked > 2:
            ranks.refresh()
            checked = time.monotonic()
            if not threading.main_thread().is_alive():  # the process is shutting down (e.g. the run was cancelled)
                raise RuntimeError("the flow run's process is exiting: stopping the launched ranks")
        if not selector.select(timeout=0.5):
            if process.poll() is not None:
                break
            continue
        line = process.stdout.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.startswith(METRICS_MARK):
            row = json.loads(line[len(METRICS_MARK) :])
            log_metrics(row["values"], row["step"])
        elif line.startswith(PROGRESS_MARK):
            row = json.loads(line[len(PROGRESS_MARK) :])
            emit(row["progress"], row["message"])
        elif line.strip():
            tail.append(line)
            log(line)
