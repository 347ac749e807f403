"""Training stages under `accelerate launch` with 2 CPU processes (gloo), as the flow runs them (`train_stage`), without
Prefect."""

from __future__ import annotations

import logging

import psutil
import pytest
from mlflow.tracking import MlflowClient

from rlhf_pipeline.tasks.config import LaunchConfig
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, RunContext, read_history
from rlhf_pipeline.tasks.training import train_stage
from rlhf_pipeline.trainers.algorithms.sft import SftConfig
from rlhf_pipeline.trainers.config import CallbackSpec
from tests.helpers import FAST, SMALL_MODEL, data_artifact, stage_context, write_data_dir

pytestmark = pytest.mark.slow  # each launch starts two Python processes with torch (~10 s)

TWO_RANKS = LaunchConfig(launcher="accelerate", num_processes=2, kill_grace_seconds=5)


@pytest.fixture
def ctx(tmp_path) -> RunContext:
    return stage_context(tmp_path, "test-launcher", TWO_RANKS)


@pytest.fixture
def data(tmp_path) -> ArtifactRef:
    return data_artifact(tmp_path)


def launched_processes(spec_dir) -> list[psutil.Process]:
    """Processes (ranks or launcher) still running this stage's launch.json."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(str(spec_dir) in part for part in process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            pass
    return found


def test_a_rank_killed_mid_stage_fails_the_stage_leaves_no_process_and_the_retry_resumes(ctx, data, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlhf")
    kill = CallbackSpec(
        path="tests.user_code:KillAtStep", kwargs={"step": 3, "rank": 1, "once": str(tmp_path / "killed")}
    )
    config = SftConfig(max_steps=4, callbacks=[kill], **{**FAST, "per_device_train_batch_size": 8, "save_steps": 2})
    before = {child.pid for child in psutil.Process().children(recursive=True)}  # e.g. a Prefect server of another test
    with pytest.raises(RuntimeError, match=r"sft: accelerate launch exited with \d+ \(a rank failed or was killed\)"):
        train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    assert (tmp_path / "killed").is_file()
    work = next((tmp_path / "artifacts" / "sft" / ".work").iterdir())
    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    assert launched_processes(work) == [] and left == []  # the launcher and every rank are gone
    # The retry (same config, same key) resumes from the newest complete checkpoint: steps 3 and 4 only.
    caplog.clear()
    outcome = train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    assert any(m == f"sft: resuming from {work / 'checkpoint-2'}" for m in caplog.messages), caplog.messages
    assert MlflowClient().get_run(outcome.mlflow_run_id).data.tags["rlhf.resumed_from"] == "checkpoint-2"
    steps = [step for step, values in read_history(outcome.ref.path) if "sft/train/loss" in values]
    assert steps[-2:] == [3, 4] and steps.count(3) == 1 + (3 in steps[:-2])
    assert outcome.ref.manifest()["training"]["global_step"] == 4


def test_a_config_a_rank_refuses_fails_at_once_with_the_same_error(ctx, data, tmp_path):
    from rlhf_pipeline.trainers.algorithms.dpo import DpoConfig
    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.load import save_model

    policy, tokenizer = load_base_model(SMALL_MODEL)
    save_model(policy, tokenizer, tmp_path / "sft" / "model")
    sft = ArtifactRef(stage="sft", key="s", uri=str(tmp_path / "sft"))
    # Checked where the parameters were made (a head node with bitsandbytes), refused in the ranks' environment (without
    # it).
    config = DpoConfig.model_construct(**{**dict(DpoConfig(max_steps=2, **FAST)), "ref_model_quantization": "8bit"})
    with pytest.raises(ValueError, match=r"(?s)dpo \(rank [01]\): .*ref_model_quantization='8bit' needs bitsandbytes"):
        train_stage("dpo", config, {}, {"data": data, "sft": sft}, ctx)


def test_ppo_on_two_ranks_resumes_a_killed_rank_to_the_same_weights_as_an_unbroken_run(ctx, data, tmp_path, caplog):
    from safetensors.torch import load_file

    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.load import save_model
    from rlhf_pipeline.trainers.ppo.config import PpoConfig
    from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig

    caplog.set_level(logging.INFO, logger="rlhf")
    policy, tokenizer = load_base_model(SMALL_MODEL)
    save_model(policy, tokenizer, tmp_path / "sft" / "model")
    inputs = {"data": data, "sft": ArtifactRef(stage="sft", key="s", uri=str(tmp_path / "sft"))}
    rewards = {
        "rewards": RewardsConfig(
            reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")]
        )
    }
    fast = dict(
        rollout_batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=1,
        total_episodes=32,
        response_length=4,
        logging_steps=1,
        save_steps=2,
        seed=3,
    )
    unbroken = train_stage("ppo", PpoConfig(**fast), rewards, inputs, ctx)
    assert "ppo: world size 2 (data-parallel, gloo), 4 rollouts per rank per update" in caplog.messages
    # Killed on rank 1 at update 3 (after checkpoint-2, which holds both ranks' RNG), then retried: the same weights.
    kill = CallbackSpec(
        path="tests.user_code:KillAtStep", kwargs={"step": 3, "rank": 1, "once": str(tmp_path / "killed")}
    )
    config = PpoConfig(**fast, callbacks=[kill])
    with pytest.raises(RuntimeError, match="ppo: accelerate launch exited"):
        train_stage("ppo", config, rewards, inputs, ctx)
    work = next(p for p in (tmp_path / "artifacts" / "ppo" / ".work").iterdir() if (p / "checkpoint-2").is_dir())
    assert {"rng.pt", "rng-1.pt"} <= {f.name for f in (work / "checkpoint-2").iterdir()}
    assert launched_processes(work) == []
    resumed = train_stage("ppo", config, rewards, inputs, ctx)
    assert MlflowClient().get_run(resumed.mlflow_run_id).data.tags["rlhf.resumed_from"] == "checkpoint-2"
    weights = {
        name: load_file(ref.path / "model" / "model.safetensors")
        for name, ref in (("unbroken", unbroken.ref), ("resumed", resumed.ref))
    }
    assert all((weights["unbroken"][k] == weights["resumed"][k]).all() for k in weights["unbroken"])
    assert resumed.metrics["ppo/train/reward"] == pytest.approx(unbroken.metrics["ppo/train/reward"])


def test_engine_configs_and_the_kubernetes_job_template_ship_with_the_package():
    import json

    import yaml

    from rlhf_pipeline.tasks.config import ENGINE_DIR, ENGINES

    kinds = {name: yaml.safe_load((ENGINE_DIR / f"{name}.yaml").read_text()) for name in ENGINES}
    assert {name: kind["distributed_type"] for name, kind in kinds.items()} == {
        "ddp": "MULTI_GPU",
        "zero2": "DEEPSPEED",
        "zero3": "DEEPSPEED",
        "fsdp2": "FSDP",
    }
    assert (
        kinds["zero3"]["deepspeed_config"]["zero3_save_16bit_model"]
        and kinds["fsdp2"]["fsdp_config"]["fsdp_version"] == 2
    )
    assert all(kind["mixed_precision"] == "no" for kind in kinds.values())  # each stage's bf16/fp16 decides
    template = json.loads((ENGINE_DIR.parent / "kubernetes" / "gpu-job-template.json").read_text())
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert {"name": "rlhf-state", "mountPath": "/state"} in container["volumeMounts"]
    assert template["variables"]["properties"]["env"]["default"]["RLHF_STATE_DIR"] == "/state"
    with pytest.raises(
        ValueError,
        match="launch.engine='zero4' is neither one of ddp, zero2, zero3, fsdp2 nor an accelerate config file",
    ):
        LaunchConfig(engine="zero4")
    import importlib.util

    # This machine: ZeRO is refused with the parameters, naming the extra
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(
            ValueError,
            match=(
                r"launch.engine='zero3' runs DeepSpeed ZeRO, which is not installed: pip install "
                r"'rlhf-pipeline\[deepspeed\]'"
            ),
        ):
            LaunchConfig(engine="zero3")


def test_sft_dpo_and_ppo_on_two_ranks_reach_the_held_out_exact_match_of_one_process_and_ray_trains_their_weights(
    ctx, tmp_path, caplog
):
    """The embedded default's sft (300 steps of 64), once in this process and once on 2 accelerate ranks of 32: the
    same held-out figure (within 3 points). Then dpo and ppo from the in-process sft, on shorter budgets than the
    preset's (so each is still moving), both ways. (The preset's full budgets side by side: `python -m
    bench.launch_parity`.) Two Ray Train workers (a local Ray cluster on 127.0.0.1, started for each stage) compute what
    the two ranks compute: a short sft and a short ppo (TRL's trainer and our own loop) end with the very weights the
    ranks end with, so they reach the ranks' held-out figure at any budget. Each launched way publishes as the
    in-process one does: rank 0's history once, the manifest's outcome and tokenizer, the metrics in MLflow; and the
    launcher is not part of a stage's key."""
    from safetensors.torch import load_file

    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.load import load_causal_lm
    from rlhf_pipeline.trainers.models.text import generate
    from rlhf_pipeline.trainers.rewards.sort_task import exact_match
    from tests.helpers import unchanged

    caplog.set_level(logging.INFO, logger="rlhf")
    params = load_params("tiny")
    data = ArtifactRef(stage="data", key="all", uri=str(write_data_dir(tmp_path / "data", rows=10**9)))
    held_out = load_split(data.path, "prompts_eval")
    inprocess = ctx.model_copy(update={"launch": LaunchConfig(launcher="inprocess")})
    # Artifacts of their own: the launcher is not in the key, so another way's artifact would be reused.
    ray = ctx.model_copy(
        update={
            "launch": LaunchConfig(launcher="ray", num_workers=2, kill_grace_seconds=5),
            "artifact_root": str(tmp_path / "ray-artifacts"),
        }
    )

    def halved(config):
        return config.model_copy(update={"per_device_train_batch_size": config.per_device_train_batch_size // 2})

    def score(ref: ArtifactRef) -> float:
        model, tokenizer = load_causal_lm(ref.path / "model")
        answers = generate(model, tokenizer, held_out["prompt"], max_new_tokens=12, batch_size=200)
        return sum(exact_match(held_out["prompt"], answers, answer=held_out["answer"])) / len(answers)

    def launched(stage, config, settings, upstream, run, halve=True):
        """The stage on two ranks or workers; the same global batch (each takes half)."""
        caplog.clear()
        outcome = train_stage(stage, halved(config) if halve else config, settings, upstream, run)
        assert any(m.startswith(f"{stage}: world size 2 ") for m in caplog.messages), caplog.messages
        if run is ray:
            assert any(m.startswith(f"{stage}: Ray cluster at a local cluster (127.0.0.1)") for m in caplog.messages)
        return outcome

    def published_as_in_process(outcome, logged: list[int], steps: int) -> None:
        """Rank 0's history once, the outcome and tokenizer in the manifest, the metrics in MLflow."""
        history = read_history(outcome.ref.path)
        assert [step for step, values in history if "sft/train/loss" in values] == logged
        manifest = outcome.ref.manifest()
        assert manifest["training"] == {"global_step": steps, "max_steps": steps, "stopped_early": False}
        assert manifest["tokenizer"] and (outcome.ref.path / "model" / "model.safetensors").is_file()
        metrics = MlflowClient().get_run(outcome.mlflow_run_id).data.metrics
        assert metrics["sft/train/loss"] == manifest["metrics"]["sft/train/loss"]

    sft = train_stage("sft", params.sft, {"model": params.model}, {"data": data}, inprocess)
    ranks = launched("sft", params.sft, {"model": params.model}, {"data": data}, ctx)
    scores = {"sft": (score(sft.ref), score(ranks.ref))}
    published_as_in_process(
        ranks, [step for step, values in read_history(sft.ref.path) if "sft/train/loss" in values], 300
    )
    # The launcher is not part of the key: the launched sft, asked for in this process, is reused.
    assert train_stage("sft", halved(params.sft), {"model": params.model}, {"data": data}, inprocess).cached
    upstream = {"data": data, "sft": sft.ref}
    dpo = params.dpo.model_copy(update={"max_steps": 60})
    dpo_ranks = launched("dpo", dpo, {}, upstream, ctx)
    assert dpo_ranks.ref.manifest()["training"]["global_step"] == 60
    assert (dpo_ranks.ref.path / "model" / "model.safetensors").is_file()
    scores["dpo"] = (score(train_stage("dpo", dpo, {}, upstream, inprocess).ref), score(dpo_ranks.ref))
    # 20 updates; the rollout batch is global (ppo splits it over the ranks itself: not halved), so both ways have one
    # key: the in-process one keeps artifacts of its own, else it would reuse the launched one and compare it to itself.
    ppo = params.ppo.model_copy(update={"total_episodes": 1280})
    ppo_ranks = launched("ppo", ppo, {"rewards": params.rewards}, upstream, ctx, halve=False)
    apart = inprocess.model_copy(update={"artifact_root": str(tmp_path / "inprocess-artifacts")})
    ppo_alone = train_stage("ppo", ppo, {"rewards": params.rewards}, upstream, apart)
    assert not ppo_alone.cached and ppo_alone.ref.key == ppo_ranks.ref.key and ppo_alone.ref.path != ppo_ranks.ref.path
    scores["ppo"] = (score(ppo_alone.ref), score(ppo_ranks.ref))
    # Each trained, and each launched figure within 3 points of the in-process one
    (sft_one, _), (dpo_one, _), (ppo_one, _) = scores["sft"], scores["dpo"], scores["ppo"]
    assert sft_one > 0.5 and dpo_one > sft_one + 0.05 and ppo_one > sft_one + 0.05, scores
    assert all(abs(launched_score - one) <= 0.03 for one, launched_score in scores.values()), scores

    # Ray: a short sft (a loss every 5 steps) and a short ppo (4 updates), on the ranks and on the workers.
    short_sft = params.sft.model_copy(update={"max_steps": 40, "logging_steps": 5})
    short_ppo = params.ppo.model_copy(update={"total_episodes": 256})
    for stage, config, settings, given, halve in (
        ("sft", short_sft, {"model": params.model}, {"data": data}, True),
        ("ppo", short_ppo, {"rewards": params.rewards}, upstream, False),
    ):
        on_ranks = launched(stage, config, settings, given, ctx, halve)
        on_workers = launched(stage, config, settings, given, ray, halve)
        weights = load_file(str(on_ranks.ref.path / "model" / "model.safetensors"))
        same = unchanged(weights, load_file(str(on_workers.ref.path / "model" / "model.safetensors")))
        assert same == sorted(weights), (stage, sorted(weights.keys() - set(same)))
        if stage == "sft":
            published_as_in_process(on_workers, [5, 10, 15, 20, 25, 30, 35, 40], 40)


def test_a_sigterm_reaches_the_ranks_which_checkpoint_and_stop_and_the_retry_resumes_there(ctx, data, tmp_path):
    import threading
    import time

    from rlhf_pipeline.trainers.runtime.stopping import TERMINATING, Terminated

    config = SftConfig(max_steps=400, **{**FAST, "per_device_train_batch_size": 8, "save_steps": 1000})
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    work = tmp_path / "artifacts" / "sft" / ".work"

    def sigterm_once_training():  # what this process's SIGTERM handler does (trainers.runtime.stopping)
        deadline = time.time() + 300
        while not list(work.glob("*/history.jsonl")) and time.time() < deadline:
            time.sleep(0.05)
        TERMINATING.set()

    threading.Thread(target=sigterm_once_training, daemon=True).start()
    try:
        with pytest.raises(Terminated, match="sft: the ranks stopped on SIGTERM; the next attempt resumes"):
            train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    finally:
        TERMINATING.clear()
    [marker] = work.glob("*/checkpoint-*/checkpoint.complete")  # both ranks stopped at the same step, rank 0 saved
    stopped_at = int(marker.parent.name.split("-")[1])
    assert 1 <= stopped_at < 400
    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    assert launched_processes(marker.parent.parent) == [] and left == []

    resumed = train_stage("sft", config, {"model": SMALL_MODEL}, {"data": data}, ctx)
    assert MlflowClient().get_run(resumed.mlflow_run_id).data.tags["rlhf.resumed_from"] == f"checkpoint-{stopped_at}"
    assert resumed.ref.manifest()["training"]["global_step"] == 400
