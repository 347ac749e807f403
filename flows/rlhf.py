"""The `rlhf` flow: data -> sft -> rm -> dpo | grpo | rloo | ppo -> eval -> registry, each a cached, retryable stage.

    python -m flows.rlhf [--config PRESET] [--set key.path=value ...] [--no-cache]
"""

from __future__ import annotations

import sys

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.params import PipelineParams, load_params
from tasks.data import validate_data
from tasks.dpo import train_dpo
from tasks.eval import evaluate
from tasks.pipeline import pipeline_run
from tasks.policy import train_grpo, train_ppo, train_rloo
from tasks.registry import register_policy
from tasks.rm import train_reward_model
from tasks.sft import train_sft


@flow(name="rlhf", persist_result=False, validate_parameters=True)
def rlhf(params: PipelineParams = load_params()) -> dict:
    """Post-train a model with RLHF: validate data, SFT, reward model, DPO/GRPO/RLOO/PPO, evaluate, register."""
    with pipeline_run(params) as run:
        # Futures wire the DAG (the Prefect UI draws it); each stage waits for the
        # one before it so that only one stage trains on the device at a time.
        data = validate_data.submit(params.data, run.ctx)
        sft_model = train_sft.submit(params.sft, params.model, data, run.ctx)
        reward_model = train_reward_model.submit(params.rm, sft_model, data, run.ctx) if params.needs_reward_model else None
        policy = optimise_policy(params, sft_model, reward_model, data, run.ctx)
        report = evaluate.submit(params.eval, params.model, data, sft_model, policy,
                                 reward_model if params.eval.use_reward_model else None, params.registry, run.ctx)  # fmt: skip
        stages = [f.result() for f in (data, sft_model, reward_model, policy, report) if f is not None]
        registered = None
        if params.registry.enabled:
            registered = registry.submit(params.registry, policy.result(), report.result(), stages, run.ctx).result()
        return run.finish(policy=policy.result(), report=report.result(), stages=stages, registered=registered)


@task(name="registry", task_run_name="registry", retries=2, retry_delay_seconds=[10, 60], cache_policy=NO_CACHE, persist_result=False)
def registry(config, policy, report, stages, ctx) -> dict:
    """Register the policy; move `champion` only if the gate passes."""
    return register_policy(config, policy, report, stages, ctx)


def optimise_policy(params: PipelineParams, sft_model, reward_model, data, ctx):
    after = [reward_model] if reward_model is not None else []
    if params.algorithm == "dpo":
        return train_dpo.submit(params.dpo, sft_model, data, ctx, wait_for=after)
    online = {"grpo": train_grpo, "rloo": train_rloo, "ppo": train_ppo}[params.algorithm]
    config = getattr(params, params.algorithm)
    return online.submit(config, params.rewards, sft_model, reward_model, data, ctx, wait_for=after)

if __name__ == "__main__":
    from flows.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
