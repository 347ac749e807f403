"""Online RL stages (`grpo`, `rloo`, `ppo`): the SFT model optimised against the configured rewards."""

from __future__ import annotations

from rlhf_pipeline.tasks.orchestration import prefect_log, stage_task
from rlhf_pipeline.tasks.stage import ArtifactRef, RunContext, StageOutcome, run_stage
from rlhf_pipeline.trainers.common import StrictModel
from rlhf_pipeline.trainers.rewards import RewardsConfig, fingerprint

TRAINERS = {"grpo": "rlhf_pipeline.trainers.grpo", "rloo": "rlhf_pipeline.trainers.rloo", "ppo": "rlhf_pipeline.trainers.ppo"}


def _train_online(
    stage: str,
    config: StrictModel,
    rewards: RewardsConfig,
    sft_model: ArtifactRef,
    reward_model: ArtifactRef | None,
    data: ArtifactRef,
    ctx: RunContext,
) -> StageOutcome:
    if rewards.uses_reward_model and reward_model is None:
        raise ValueError(f"{stage}: rewards.reward_model_weight={rewards.reward_model_weight} needs the rm stage's model")

    def build(out_dir, work_dir, log_metrics):
        import importlib

        trainer = importlib.import_module(TRAINERS[stage])
        scorer = reward_model.path / "model" if rewards.uses_reward_model else None
        return trainer.train(config, rewards, sft_model.path / "model", scorer, data.path, out_dir, work_dir, log_metrics)

    upstream = {"sft": sft_model, "data": data}
    if rewards.uses_reward_model:
        upstream["rm"] = reward_model
    settings = {stage: config.model_dump(mode="json"), "rewards": rewards.model_dump(mode="json")}
    return run_stage(stage, settings, upstream, ctx, build, fingerprints=fingerprint(rewards), log=prefect_log)


@stage_task("grpo")
def train_grpo(config, rewards: RewardsConfig, sft_model: ArtifactRef, reward_model: ArtifactRef | None, data: ArtifactRef, ctx: RunContext) -> StageOutcome:
    return _train_online("grpo", config, rewards, sft_model, reward_model, data, ctx)


@stage_task("rloo")
def train_rloo(config, rewards: RewardsConfig, sft_model: ArtifactRef, reward_model: ArtifactRef | None, data: ArtifactRef, ctx: RunContext) -> StageOutcome:
    return _train_online("rloo", config, rewards, sft_model, reward_model, data, ctx)


@stage_task("ppo")
def train_ppo(config, rewards: RewardsConfig, sft_model: ArtifactRef, reward_model: ArtifactRef | None, data: ArtifactRef, ctx: RunContext) -> StageOutcome:
    return _train_online("ppo", config, rewards, sft_model, reward_model, data, ctx)
