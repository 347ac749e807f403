"""The `rlhf` flow: data -> sft -> rm -> dpo | grpo | rloo | ppo -> eval -> registry, each a cached, retryable stage.

    python -m flows.rlhf [--config PRESET] [--set key.path=value ...] [--no-cache]
    prefect deployment run rlhf/full -p algorithm=grpo -p grpo='{"beta": 0.1}'

Its parameters are the fields of `PipelineParams`, one per stage block, so a
deployment run can override a block (or one field of it: blocks merge onto
the preset) and the Prefect UI draws one typed section per stage.
"""

from __future__ import annotations

import sys
from typing import Literal

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from rlhf_pipeline.flows.params import PipelineParams, described_by, from_flow_parameters, load_params
from rlhf_pipeline.tasks.data import validate_data
from rlhf_pipeline.tasks.dpo import train_dpo
from rlhf_pipeline.tasks.eval import evaluate
from rlhf_pipeline.tasks.orchestration import RetryConfig, is_transient, retrying
from rlhf_pipeline.tasks.pipeline import pipeline_run
from rlhf_pipeline.tasks.policy import train_grpo, train_ppo, train_rloo
from rlhf_pipeline.tasks.registry import RegistryConfig, register_policy
from rlhf_pipeline.tasks.rm import train_reward_model
from rlhf_pipeline.tasks.sft import train_sft
from rlhf_pipeline.trainers.common import ModelConfig
from rlhf_pipeline.trainers.data import DataConfig
from rlhf_pipeline.trainers.dpo import DpoConfig
from rlhf_pipeline.trainers.eval import EvalConfig
from rlhf_pipeline.trainers.grpo import GrpoConfig
from rlhf_pipeline.trainers.ppo import PpoConfig
from rlhf_pipeline.trainers.rewards import RewardsConfig
from rlhf_pipeline.trainers.rloo import RlooConfig
from rlhf_pipeline.trainers.rm import RewardConfig
from rlhf_pipeline.trainers.sft import SftConfig

TINY = load_params()  # the defaults: the embedded preset


@flow(name="rlhf", persist_result=False, validate_parameters=True)
@described_by(PipelineParams)
def rlhf(
    algorithm: Literal["dpo", "grpo", "rloo", "ppo"] = TINY.algorithm,
    preset: str | None = TINY.preset,
    experiment_name: str = TINY.experiment_name,
    no_cache: bool = TINY.no_cache,
    model: ModelConfig = TINY.model,
    data: DataConfig = TINY.data,
    sft: SftConfig = TINY.sft,
    rm: RewardConfig = TINY.rm,
    dpo: DpoConfig = TINY.dpo,
    rewards: RewardsConfig = TINY.rewards,
    grpo: GrpoConfig = TINY.grpo,
    rloo: RlooConfig = TINY.rloo,
    ppo: PpoConfig = TINY.ppo,
    eval: EvalConfig = TINY.eval,
    registry: RegistryConfig = TINY.registry,
    retry: RetryConfig = TINY.retry,
) -> dict:
    """Post-train a model with RLHF: validate data, SFT, reward model, DPO/GRPO/RLOO/PPO, evaluate, register."""
    params = from_flow_parameters(PipelineParams, locals())
    with pipeline_run(params) as run:
        # Futures wire the DAG (the Prefect UI draws it); each stage waits for the
        # one before it so that only one stage trains on the device at a time.
        stage = retrying(params.retry)
        data = stage(validate_data).submit(params.data, run.ctx, params.model, params.token_limits())
        sft_model = stage(train_sft).submit(params.sft, params.model, data, run.ctx)
        reward_model = stage(train_reward_model).submit(params.rm, sft_model, data, run.ctx) if params.needs_reward_model else None
        policy = optimise_policy(params, sft_model, reward_model, data, run.ctx)
        report = stage(evaluate).submit(params.eval, params.model, data, sft_model, policy,
                                 reward_model if params.eval.use_reward_model else None, params.registry, run.ctx)  # fmt: skip
        stages = [f.result() for f in (data, sft_model, reward_model, policy, report) if f is not None]
        registered = None
        if params.registry.enabled:
            registered = stage(register).submit(params.registry, policy.result(), report.result(), stages, run.ctx).result()
        return run.finish(policy=policy.result(), report=report.result(), stages=stages, registered=registered)


@task(name="registry", task_run_name="registry", retry_condition_fn=is_transient, cache_policy=NO_CACHE, persist_result=False)
def register(config, policy, report, stages, ctx) -> dict:
    """Register the policy; move `champion` only if the gate passes."""
    return register_policy(config, policy, report, stages, ctx)


def optimise_policy(params: PipelineParams, sft_model, reward_model, data, ctx):
    after = [reward_model] if reward_model is not None else []
    if params.algorithm == "dpo":
        return retrying(params.retry)(train_dpo).submit(params.dpo, sft_model, data, ctx, wait_for=after)
    online = {"grpo": train_grpo, "rloo": train_rloo, "ppo": train_ppo}[params.algorithm]
    config = getattr(params, params.algorithm)
    return retrying(params.retry)(online).submit(config, params.rewards, sft_model, reward_model, data, ctx, wait_for=after)


if __name__ == "__main__":
    from rlhf_pipeline.flows.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
