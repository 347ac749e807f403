"""A stage that stops making progress fails as stalled, with every thread's stack in the log, and its retry resumes
from the last checkpoint: a reward function that hangs (in the flow run's process), a rank that hangs while the other
waits in a collective (under accelerate)."""

from __future__ import annotations

import logging
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from rlhf_pipeline.tasks.config import LaunchConfig
from rlhf_pipeline.tasks.training import train_stage
from rlhf_pipeline.trainers.algorithms.sft import SftConfig
from rlhf_pipeline.trainers.config import CallbackSpec
from rlhf_pipeline.trainers.runtime.heartbeat import Stalled
from tests import user_code
from tests.flows.helpers import run, task_runs
from tests.helpers import FAST, SMALL_MODEL, data_artifact, stage_context

pytestmark = pytest.mark.slow


def test_a_reward_function_that_hangs_fails_its_attempt_as_stalled_and_the_retry_completes_the_run(
    prefect, state, tmp_path, monkeypatch
):
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    monkeypatch.setenv("RLHF_TEST_HANG_ONCE", str(tmp_path / "hung"))
    monkeypatch.setattr(user_code, "REWARD_CALLS", [])
    started = time.monotonic()
    done = run(
        "algorithm=grpo",
        "grpo.max_steps=4",
        "grpo.save_steps=1",
        "rewards.reward_model_weight=0",
        "rewards.functions=[{path: tests.user_code:reward_that_hangs_once}]",
        "eval.use_reward_model=false",
        "registry.enabled=false",
        "retry.stall_seconds=5",
        "retry.delay_seconds=[1]",
    )
    assert done.is_completed(), done.message
    assert (tmp_path / "hung").is_file() and time.monotonic() - started < 300
    [grpo] = [t for t in task_runs(done.state_details.flow_run_id) if t.name == "grpo"]
    assert grpo.run_count == 2  # the stalled attempt, then the retry
    with get_client(sync_client=True) as client:
        logs = [
            log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[grpo.flow_run_id])))
        ]
    [stalled] = [m for m in logs if m.startswith("grpo: no progress for")]
    assert "reward_that_hangs_once" in stalled and "hang_forever" in stalled  # the stack names the hang
    assert any(m.startswith("grpo: resuming from") for m in logs), logs
    runs = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name("rlhf").experiment_id], "attributes.run_name = 'grpo'"
    )
    assert {r.info.status for r in runs if r.data.tags.get("rlhf.cached") == "false"} >= {"FAILED", "FINISHED"}


def test_a_rank_that_hangs_stalls_the_launch_which_is_stopped_with_the_ranks_stacks_and_the_retry_resumes(
    tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="rlhf")
    ctx = stage_context(tmp_path, "test-stalls", LaunchConfig(launcher="accelerate", num_processes=2))
    ctx = ctx.model_copy(update={"stall_seconds": 10.0})  # the hang is for ever: margin for a loaded first step
    data = data_artifact(tmp_path)
    hang = CallbackSpec(
        path="tests.user_code:HangAtStep", kwargs={"step": 3, "rank": 1, "once": str(tmp_path / "hung")}
    )
    config = SftConfig(max_steps=4, callbacks=[hang], **{**FAST, "per_device_train_batch_size": 8, "save_steps": 2})
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(Stalled, match="sft: stalled"):
        train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    assert (tmp_path / "hung").is_file()
    logged = "\n".join(caplog.messages)
    assert "sft: no progress for" in logged
    assert "in hang_forever" in logged  # the hung rank's own stack, from its faulthandler
    assert [c for c in psutil.Process().children(recursive=True) if c.pid not in before] == []  # no rank left
    caplog.clear()
    # The retry's own watchdog is not what is checked here; under the suite's load its first step after the resume
    # (the checkpoint loaded, two ranks' DDP set up again) has taken over 5 s on a slow VM.
    ctx = ctx.model_copy(update={"stall_seconds": 120.0})
    outcome = train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    assert any(m.startswith("sft: resuming from") and m.endswith("checkpoint-2") for m in caplog.messages)
    assert outcome.ref.manifest()["training"]["global_step"] == 4
