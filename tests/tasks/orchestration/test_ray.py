"""Training stages as Ray Train jobs (`launch.launcher: ray`) on a real Ray cluster of two nodes on this host (a head
and a second node joining it, each its own process: tests/ray_cluster.py), as the flow runs them (`train_stage`),
without Prefect."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from rlhf_pipeline.tasks.config import LaunchConfig
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, RunContext, read_history
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.training import train_stage
from rlhf_pipeline.trainers.algorithms.sft import SftConfig
from rlhf_pipeline.trainers.config import CallbackSpec
from tests import ray_cluster
from tests.helpers import FAST, SMALL_MODEL, data_artifact, stage_context

pytestmark = pytest.mark.slow  # a Ray cluster of two nodes, and each stage starts two Ray workers with torch

SPREAD = LaunchConfig(launcher="ray", num_workers=2, placement_strategy="STRICT_SPREAD", kill_grace_seconds=5)
"""Two workers, one on each node."""


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster.two_nodes() as env, pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():  # the stage's driver (a child of this process) joins it
            patch.setenv(name, value)
        yield env


@pytest.fixture
def ctx(tmp_path, cluster) -> RunContext:
    return stage_context(tmp_path, "test-ray", SPREAD)


@pytest.fixture
def data(tmp_path) -> ArtifactRef:
    return data_artifact(tmp_path)


WORKER_LINE = re.compile(r"ray worker (\d+)/(\d+) on node (\w+) \(([\d.]+)\)")
"""The line each worker sends first: `ray worker <rank>/<world> on node <id> (<ip>)`."""


def placed(messages: list[str]) -> dict[int, str]:
    """Each worker's node, from its line (the last stage's, where several ran)."""
    found = (WORKER_LINE.fullmatch(m) for m in messages)
    return {int(m[1]): f"{m[3]} ({m[4]})" for m in found if m}


def test_a_worker_killed_mid_stage_fails_the_attempt_and_the_retry_resumes_from_its_checkpoint(
    ctx, data, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="rlhf")
    kill = CallbackSpec(
        path="tests.user_code:KillAtStep", kwargs={"step": 3, "rank": 1, "once": str(tmp_path / "killed")}
    )
    config = SftConfig(max_steps=4, callbacks=[kill], **{**FAST, "per_device_train_batch_size": 8, "save_steps": 2})
    with pytest.raises(RuntimeError, match=r"sft: the Ray job exited with 1 \(a rank failed or was killed\)"):
        train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    assert (tmp_path / "killed").is_file()
    left = psutil.wait_procs(ray_cluster.train_workers(os.environ["RAY_ADDRESS"]), timeout=30)[1]
    assert left == []  # the other worker ended with the job
    work = next((tmp_path / "artifacts" / "sft" / ".work").iterdir())
    caplog.clear()
    outcome = train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    assert any(m == f"sft: resuming from {work / 'checkpoint-2'}" for m in caplog.messages), caplog.messages
    assert MlflowClient().get_run(outcome.mlflow_run_id).data.tags["rlhf.resumed_from"] == "checkpoint-2"
    steps = [step for step, values in read_history(outcome.ref.path) if "sft/train/loss" in values]
    assert steps[-2:] == [3, 4]  # the retry trained steps 3 and 4 only
    assert outcome.ref.manifest()["training"]["global_step"] == 4


def test_an_error_no_retry_fixes_fails_at_once_with_its_type_and_a_cluster_too_small_before_any_worker(
    ctx, data, tmp_path
):
    config = SftConfig(max_steps=2, **{**FAST, "optimizer_factory": "tests.user_code:frozen_only"})
    with pytest.raises(ValueError, match=r"sft \(rank [01]\): "):
        train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    three = ctx.model_copy(update={"launch": SPREAD.model_copy(update={"num_workers": 3})})
    with pytest.raises(
        ValueError,
        match=r"sft: the Ray cluster at 127\.0\.0\.2:\d+ cannot hold the stage's workers: placement_strategy "
        r"STRICT_SPREAD puts each of 3 workers on a node of its own; it has 2",
    ):
        train_stage("sft", SftConfig(max_steps=2, **FAST), {"model": SMALL_MODEL}, {"data": data}, three)
    gpus = ctx.model_copy(
        update={
            "launch": SPREAD.model_copy(
                update={"resources_per_worker": {"CPU": 1, "GPU": 1}, "placement_strategy": "PACK"}
            )
        }
    )
    with pytest.raises(
        ValueError,
        match=r"launch.num_workers=2 x launch.resources_per_worker=\{CPU: 1, GPU: 1\}, and its 2 node\(s\) hold 0",
    ):
        train_stage("sft", SftConfig(max_steps=2, **FAST), {"model": SMALL_MODEL}, {"data": data}, gpus)


@pytest.fixture(scope="module")
def sft_ref(tmp_path_factory) -> ArtifactRef:
    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.load import save_model

    folder = tmp_path_factory.mktemp("sft")
    policy, tokenizer = load_base_model(SMALL_MODEL)
    save_model(policy, tokenizer, folder / "model")
    return ArtifactRef(stage="sft", key="s", uri=str(folder))


HALF = {**FAST, "per_device_train_batch_size": 4, "max_steps": 2}
"""Each of the two workers takes 4 rows a step: the global batch of 8 that the stages' own tests train with."""


@pytest.mark.parametrize("stage", ["kto", "orpo", "grpo", "rloo"])  # sft, rm and dpo: the pipeline's test below
def test_every_other_trl_stage_trains_on_two_workers(ctx, data, sft_ref, stage, caplog):
    """kto's driver joins through Ray client (`launch.ray_address=ray://<head>:<client port>`), as a Prefect job's pod
    beside a KubeRay cluster reaches it, from a machine that is no node; the others through the cluster's address."""
    from rlhf_pipeline.tasks.stages import BY_NAME
    from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig

    caplog.set_level(logging.INFO, logger="rlhf")
    online = {"max_completion_length": 6, "num_generations": 4} if stage in ("grpo", "rloo") else {}
    settings = (
        {
            "rewards": RewardsConfig(
                reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")]
            )
        }
        if stage in ("grpo", "rloo")
        else {}
    )
    config = BY_NAME[stage].config(**HALF, **online)
    if stage == "kto":
        client = SPREAD.model_copy(update={"ray_address": os.environ[ray_cluster.CLIENT]})
        ctx = ctx.model_copy(update={"launch": client})
    outcome = train_stage(stage, config, settings, {"data": data, "sft": sft_ref}, ctx)
    assert f"{stage}: world size 2 (distributed, gloo)" in caplog.messages, caplog.messages
    if stage == "kto":
        assert any(m.startswith("kto: Ray cluster at ray://127.0.0.2:") for m in caplog.messages), caplog.messages
    assert len(set(placed(caplog.messages).values())) == 2
    assert outcome.ref.manifest()["training"]["global_step"] == 2
    assert (outcome.ref.path / "model" / "model.safetensors").is_file()
    assert [step for step, values in read_history(outcome.ref.path) if f"{stage}/train/loss" in values] == [1, 2]


def test_the_pipeline_runs_end_to_end_with_its_training_stages_on_the_ray_cluster(
    cluster, prefect, tmp_path, monkeypatch, caplog
):
    """The flow as users start it (`--set launch.launcher=ray ...`): every training stage a Ray job of two workers, one
    on each node; Prefect's task states and logs and the eval as on one machine. Each stage publishes as in one
    process: rank 0's history once, the manifest's outcome and tokenizer, its metrics in MLflow; and the launcher is
    not part of a stage's key (the same run in one process reuses every stage)."""
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from rlhf_pipeline.flows.params import load_params
    from tests.flows.helpers import DPO_RUN_STAGES, run, task_states
    from tests.helpers import CI_PRESET

    caplog.set_level(logging.INFO, logger="rlhf")
    monkeypatch.setenv(tracking.STATE_ENV, str(tmp_path / "state"))
    settings = ["registry.enabled=false", "experiment_name=ray"]
    state = run("launch.launcher=ray", "launch.num_workers=2", "launch.placement_strategy=STRICT_SPREAD", *settings)
    assert state.is_completed(), state.message
    assert task_states(state) == {stage: "Completed" for stage in DPO_RUN_STAGES}
    assert any(m.startswith("sft: Ray cluster at 127.0.0.2:") and "2 node(s), 2 CPUs" in m for m in caplog.messages)
    lines = (WORKER_LINE.fullmatch(m) for m in caplog.messages)
    # each stage's two workers: one on each node
    addresses = sorted(found[4] for found in lines if found and found[2] == "2")
    assert addresses == sorted([ray_cluster.HEAD, ray_cluster.SECOND] * 3), addresses
    summary, params = state.result(), load_params(CI_PRESET)
    for stage in ("sft", "rm", "dpo"):
        folder = Path(summary["artifacts"][stage])
        steps = getattr(params, stage).max_steps
        logged = [step for step, values in read_history(folder) if f"{stage}/train/loss" in values]
        assert logged == list(range(2, steps + 1, 2)), (stage, logged)  # logging_steps 2: rank 0's, once
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["training"] == {"global_step": steps, "max_steps": steps, "stopped_early": False}
        assert manifest["tokenizer"] and (folder / "model" / "model.safetensors").is_file()
        [tracked] = MlflowClient().search_runs(
            [tracking.experiment_id("ray")], f"attributes.run_name = '{stage}'", max_results=1
        )
        assert tracked.data.metrics[f"{stage}/train/loss"] == manifest["metrics"][f"{stage}/train/loss"]
    wanted = [f"{stage}: world size 2 (distributed, gloo)" for stage in ("sft", "rm", "dpo")]
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:  # shipped in batches from a worker thread: the last ones may arrive after the run has ended
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
            messages = [log.message for log in logs]
            if all(line in messages for line in wanted) or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert all(line in messages for line in wanted), [m for m in messages if "world size" in m or "Ray" in m]
    assert "eval/heldout/policy_exact_match" in state.result()["metrics"]
    # The last stage's workers end with its job, seconds after its driver.
    assert psutil.wait_procs(ray_cluster.train_workers(os.environ["RAY_ADDRESS"]), timeout=30)[1] == []
    again = run("launch.launcher=inprocess", *settings)
    assert again.is_completed(), again.message
    assert task_states(again) == {stage: "Cached" for stage in DPO_RUN_STAGES}
