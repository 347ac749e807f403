"""`rm`: the reward model, a scalar head on the SFT model trained on preference pairs."""

from __future__ import annotations

from rlhf_pipeline.tasks.orchestration import prefect_log, stage_task
from rlhf_pipeline.tasks.stage import ArtifactRef, RunContext, StageOutcome, run_stage
from rlhf_pipeline.trainers.rm import RewardConfig


@stage_task("rm")
def train_reward_model(config: RewardConfig, sft_model: ArtifactRef, data: ArtifactRef, ctx: RunContext) -> StageOutcome:
    def build(out_dir, work_dir, log_metrics):
        from rlhf_pipeline.trainers import rm

        return rm.train(config, sft_model.path / "model", data.path, out_dir, work_dir, log_metrics)

    return run_stage("rm", config, {"sft": sft_model, "data": data}, ctx, build, log=prefect_log)
