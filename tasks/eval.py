"""`eval`: held-out exact match of base, SFT and policy; reward-model accuracy and mean rewards."""

from __future__ import annotations

from tasks.stage import ArtifactRef, RunContext, StageOutcome, prefect_log, run_stage, stage_task
from trainers.common import ModelConfig
from trainers.eval import EvalConfig


@stage_task("eval")
def evaluate(
    config: EvalConfig,
    model: ModelConfig,
    data: ArtifactRef,
    sft_model: ArtifactRef,
    policy: ArtifactRef,
    reward_model: ArtifactRef | None,
    ctx: RunContext,
) -> StageOutcome:
    def build(out_dir, work_dir, log_metrics):
        from trainers import eval as evaluation

        return evaluation.evaluate(
            config,
            model,
            sft_model.path / "model",
            policy.path / "model",
            reward_model.path / "model" if reward_model else None,
            data.path,
            out_dir,
            policy_stage=policy.stage,
        )

    upstream = {"data": data, "sft": sft_model, "policy": policy}
    if reward_model:
        upstream["rm"] = reward_model
    settings = {"eval": config.model_dump(mode="json"), "model": model.model_dump(mode="json")}
    return run_stage("eval", settings, upstream, ctx, build, log_files=("summary.json", "summary.md", "samples.jsonl"), log=prefect_log)
