"""A flow run killed with SIGKILL mid-training resumes from its newest complete checkpoint; one stopped with SIGTERM
writes a checkpoint first, and resumes from that one.

The runs are real `rlhf run` processes (each with its temporary Prefect server);
the kill takes the whole process group, as a preempted node would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_pipeline.tasks.store.artifacts import read_history
from tests.prefect_db import seeded

pytestmark = pytest.mark.slow  # a pipeline run end to end: the fast loop skips it (-m 'not slow')

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "algorithm=dpo",
    "eval.use_reward_model=false",
    "registry.enabled=false",
    "eval.max_prompts=50",
    "sft.max_steps=60",
    "sft.save_steps=20",
    "sft.logging_steps=5",
    "dpo.max_steps=30",
    "dpo.save_steps=10",
    "dpo.logging_steps=5",
]


def start(state: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "RLHF_STATE_DIR": str(state),
        "MLFLOW_TRACKING_URI": f"sqlite:///{state / 'mlflow.db'}",
        "PREFECT_HOME": seeded(state / "prefect"),
    }
    args = [sys.executable, "-m", "rlhf_pipeline", "run", *(f"--set={item}" for item in (*SETTINGS, *extra))]
    with open(log, "a") as out:
        return subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_after_checkpoint(process: subprocess.Popen, state: Path, stage: str, log: Path, timeout: float = 300) -> int:
    """SIGKILL the run's process group once `stage` has a complete checkpoint; return that checkpoint's step."""
    deadline = time.time() + timeout
    while True:
        done = list((state / "artifacts" / stage / ".work").glob("*/checkpoint-*/checkpoint.complete"))
        if done:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return max(int(marker.parent.name.split("-")[1]) for marker in done)
        assert process.poll() is None, f"the run ended before a {stage} checkpoint:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"no {stage} checkpoint within {timeout}s"
        time.sleep(0.05)


def finish(process: subprocess.Popen, log: Path) -> None:
    assert process.wait(600) == 0, log.read_text()[-4000:]


def manifest_metrics(state: Path, stage: str) -> dict[str, float]:
    [manifest] = (state / "artifacts" / stage).glob("*/manifest.json")
    return json.loads(manifest.read_text())["metrics"]


def digest(state: Path, stage: str) -> str:
    [manifest] = (state / "artifacts" / stage).glob("*/manifest.json")
    return json.loads(manifest.read_text())["digest"]


def different_files(first: Path, second: Path, stage: str) -> list[str]:
    [one], [two] = ((state / "artifacts" / stage).glob("*/manifest.json") for state in (first, second))
    files = [json.loads(m.read_text()).get("files", {}) for m in (one, two)]
    return sorted(path for path in set(files[0]) | set(files[1]) if files[0].get(path) != files[1].get(path))


def test_a_killed_run_resumes_sft_and_dpo_from_their_checkpoints_and_ends_where_an_unbroken_run_ends(tmp_path):
    from mlflow.tracking import MlflowClient

    unbroken, crashed = tmp_path / "unbroken", tmp_path / "crashed"
    log = tmp_path / "runs.log"
    finish(start(unbroken, log), log)

    sft_step = kill_after_checkpoint(start(crashed, log), crashed, "sft", log)
    dpo_step = kill_after_checkpoint(start(crashed, log), crashed, "dpo", log)  # sft resumes and finishes here
    assert 20 <= sft_step < 60 and 10 <= dpo_step < 30
    finish(start(crashed, log), log)

    mlflow = MlflowClient(tracking_uri=f"sqlite:///{crashed / 'mlflow.db'}")
    experiment = mlflow.get_experiment_by_name("rlhf").experiment_id
    for stage, resumed_at, total in (("sft", sft_step, 60), ("dpo", dpo_step, 30)):
        runs = mlflow.search_runs([experiment], f"attributes.run_name = '{stage}' and tags.`rlhf.cached` = 'false'")
        by_status = sorted(run.info.status for run in runs)
        assert by_status == ["FINISHED", "KILLED"], by_status  # the killed attempt is closed, not left RUNNING
        [resumed] = [run for run in runs if run.info.status == "FINISHED"]
        assert resumed.data.tags["rlhf.resumed_from"] == f"checkpoint-{resumed_at}"
        steps = sorted({m.step for m in mlflow.get_metric_history(resumed.info.run_id, f"{stage}/train/loss")})
        # The step counter continues after the checkpoint and stops at the configured total.
        assert steps == list(range(resumed_at + 5, total + 1, 5)), steps

        expected, got = manifest_metrics(unbroken, stage), manifest_metrics(crashed, stage)
        assert abs(got[f"{stage}/train/loss"] - expected[f"{stage}/train/loss"]) < 1e-4, (stage, got, expected)
        # Byte for byte the unbroken run's artifact: the weights, and the card's average loss and token count too.
        assert digest(crashed, stage) == digest(unbroken, stage), different_files(crashed, unbroken, stage)
    final = manifest_metrics(crashed, "eval")["eval/heldout/policy_exact_match"]
    assert abs(final - manifest_metrics(unbroken, "eval")["eval/heldout/policy_exact_match"]) <= 0.02


def wait_for_a_logged_sft_step(process: subprocess.Popen, state: Path, log: Path, after: int = 0) -> None:
    """Until sft's work folder holds a logged step past `after`."""

    def logged() -> list[int]:
        return [
            step for folder in (state / "artifacts" / "sft" / ".work").glob("*") for step, _ in read_history(folder)
        ]

    deadline = time.time() + 300
    while not [step for step in logged() if step > after]:
        assert process.poll() is None, f"the run ended before sft trained:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, "sft logged no step within 300s"
        time.sleep(0.05)


def temporary_server_answers(output: str) -> bool:
    """Whether the temporary Prefect server this run's output names still accepts connections."""
    import re
    import socket

    port = int(re.search(r"Starting temporary Prefect server on http://127\.0\.0\.1:(\d+)", output)[1])
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def prefect_states(state: Path) -> tuple[list[str], list[str]]:
    """The flow runs' and task runs' state types in the run's temporary server's database (read after it stopped)."""
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(state / "prefect" / "prefect.db")) as store:
        flows = [row[0] for row in store.execute("SELECT state_type FROM flow_run")]
        tasks = [row[0] for row in store.execute("SELECT state_type FROM task_run")]
    return flows, tasks


def test_ctrl_c_then_sigterm_mid_sft_each_checkpoint_and_stop_and_each_next_run_resumes_from_the_last(tmp_path):
    """Ctrl-C mid-sft checkpoints, cancels the run, stops the server last and exits 130; the next run resumes there and
    a SIGTERM mid-sft (as Kubernetes and Prefect's runner send it) checkpoints again and exits within the grace; the
    third run resumes from that checkpoint and finishes. One chain: each interruption's resumed run is the next one."""
    from mlflow.tracking import MlflowClient

    from rlhf_pipeline.trainers.runtime.stopping import DEFAULT_GRACE

    state, log = tmp_path / "state", tmp_path / "run.log"
    no_periodic_checkpoint = "sft.save_steps=1000"  # the only checkpoints are the ones Ctrl-C and SIGTERM write
    process = start(state, log, no_periodic_checkpoint)
    wait_for_a_logged_sft_step(process, state, log)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal sends Ctrl-C: to every process of the foreground group
    sent = time.time()
    code = process.wait(DEFAULT_GRACE + 30)
    output = log.read_text()
    assert code == 130, (code, output[-3000:])
    assert time.time() - sent < DEFAULT_GRACE, f"exited {time.time() - sent:.1f}s after Ctrl-C"
    assert "Traceback" not in output and "All connection attempts failed" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert "resumes from the last checkpoint" in last and "rlhf run --set=algorithm=dpo" in last, last
    assert not temporary_server_answers(output)
    interrupted = checkpoint_steps(state)
    assert len(interrupted) == 1 and 5 <= interrupted[0] < 60, interrupted
    flows, tasks = prefect_states(state)
    assert flows == ["CANCELLED"] and "RUNNING" not in tasks and "PENDING" not in tasks, (flows, tasks)
    mlflow = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    experiment = mlflow.get_experiment_by_name("rlhf").experiment_id
    statuses = {run.info.run_name: run.info.status for run in mlflow.search_runs([experiment])}
    assert "RUNNING" not in statuses.values() and statuses["sft"] == "FAILED", statuses  # sft: its Terminated

    # The next run resumes from that checkpoint; a SIGTERM once sft has logged a step past it.
    process = start(state, log, no_periodic_checkpoint)
    wait_for_a_logged_sft_step(process, state, log, after=interrupted[0])
    os.kill(process.pid, signal.SIGTERM)  # the main process only, as Kubernetes and Prefect's runner send it
    sent = time.time()
    code = process.wait(DEFAULT_GRACE + 30)
    assert time.time() - sent < DEFAULT_GRACE, f"exited {time.time() - sent:.1f}s after SIGTERM"
    assert code == -signal.SIGTERM, (code, log.read_text()[-3000:])  # it still ends as SIGTERM ends a process
    terminated = checkpoint_steps(state)[-1]
    assert interrupted[0] < terminated < 60 and not list((state / "artifacts" / "sft").glob("[0-9a-f]*/manifest.json"))

    finish(start(state, log, no_periodic_checkpoint), log)
    runs = mlflow.search_runs([experiment], "attributes.run_name = 'sft' and tags.`rlhf.cached` = 'false'")
    resumed = {run.data.tags.get("rlhf.resumed_from"): run for run in runs}
    assert sorted(run.info.status for run in runs) == ["FAILED", "FAILED", "FINISHED"], runs
    second, third = resumed[f"checkpoint-{interrupted[0]}"], resumed[f"checkpoint-{terminated}"]
    assert second.info.status == "FAILED"
    assert "Terminated: stopped by SIGTERM after step" in second.data.tags["rlhf.error"]
    assert third.info.status == "FINISHED"
    steps = sorted({m.step for m in mlflow.get_metric_history(third.info.run_id, "sft/train/loss")})
    assert steps and steps[0] > terminated and steps[-1] == 60, steps  # the step counter continues from the signal


def checkpoint_steps(state: Path) -> list[int]:
    """The steps of sft's complete checkpoints in its work folder, in order."""
    markers = (state / "artifacts" / "sft" / ".work").glob("*/checkpoint-*/checkpoint.complete")
    return sorted(int(marker.parent.name.split("-")[1]) for marker in markers)


def test_a_second_ctrl_c_exits_at_once_without_tracebacks(tmp_path):
    state, log = tmp_path / "state", tmp_path / "run.log"
    # Stopped while eval generates: no checkpoint to wait for, but the first Ctrl-C waits for the flow to record its
    # end (interrupt.SETTLE_SECONDS), and eval on every held-out prompt keeps it busy longer than that.
    process = start(state, log, "sft.max_steps=4", "dpo.max_steps=2", "eval.max_prompts=600")
    deadline = time.time() + 300
    while not list((state / "artifacts" / "eval").glob(".tmp-*")):
        assert process.poll() is None, f"the run ended before eval started:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, "eval did not start within 300s"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    sent = time.time()
    code = process.wait(30)
    output = log.read_text()
    assert code == 130 and time.time() - sent < 3, (code, time.time() - sent, output[-3000:])
    assert "Traceback" not in output and "stopped at once" in output, output[-3000:]
    assert not temporary_server_answers(output)
