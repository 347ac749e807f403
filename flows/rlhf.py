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


@flow(name="rlhf", persist_result=False, validate_parameters=True)
def rlhf(params: PipelineParams = load_params()) -> dict:
    """Post-train a model with RLHF: validate data, SFT, reward model, DPO, evaluate."""
    with pipeline_run(params) as run:
        # Futures wire the DAG (the Prefect UI draws it); each stage waits for the
        # one before it so that only one stage trains on the device at a time.
        data = validate_data.submit(params.data, run.ctx)
        sft_model = train_sft.submit(params.sft, params.model, data, run.ctx)
        reward_model = train_reward_model.submit(params.rm, sft_model, data, run.ctx)
        policy = train_dpo.submit(params.dpo, sft_model, data, run.ctx, wait_for=[reward_model])
        report = evaluate.submit(params.eval, params.model, data, sft_model, policy, reward_model, run.ctx)
        stages = [future.result() for future in (data, sft_model, reward_model, policy, report)]
        return run.finish(policy=stages[3], report=stages[4], stages=stages)

if __name__ == "__main__":
    from flows.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
