"""The `rlhf` flow: data -> sft -> rm -> dpo -> eval, each a cached, retryable stage.

    python -m flows.rlhf [--config PRESET] [--set key.path=value ...] [--no-cache]
"""

from __future__ import annotations

import sys

from prefect import flow

from flows.params import PipelineParams, load_params
from tasks.dpo import train_dpo
from tasks.eval import evaluate
from tasks.pipeline import pipeline_run
from tasks.data import validate_data
from tasks.rm import train_reward_model
from tasks.sft import train_sft


@flow(name="rlhf", log_prints=True, persist_result=False, validate_parameters=True)
def rlhf(params: PipelineParams = load_params()) -> dict:
    """Post-train a model with RLHF: validate data, SFT, reward model, DPO, evaluate."""
    with pipeline_run(params) as run:
        data = validate_data(params.data, run.ctx)
        sft_model = train_sft(params.sft, params.model, data, run.ctx)
        reward_model = train_reward_model(params.rm, sft_model, data, run.ctx)
        policy = train_dpo(params.dpo, sft_model, data, run.ctx)
        report = evaluate(params.eval, params.model, data, sft_model, policy, reward_model, run.ctx)
        return run.finish(policy=policy, report=report, stages=[data, sft_model, reward_model, policy, report])


if __name__ == "__main__":
    from flows.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
