"""The `rlhf` flow: data -> sft -> rm -> dpo | kto | grpo | rloo | ppo -> eval -> registry, wired from the table of stages.

    rlhf run [--config PRESET] [--set key.path=value ...] [--no-cache]
    prefect deployment run rlhf/full -p algorithm=grpo -p grpo='{"beta": 0.1}'

Its parameters are the fields of `PipelineParams`, one block per stage of
`tasks.stages.STAGES` plus the run's settings, so a deployment run can override
a block (or one field of it: blocks merge onto the preset) and the Prefect UI
draws one typed section per stage.
"""

from __future__ import annotations

import inspect

from prefect import flow

from rlhf_pipeline.flows.params import PipelineParams, described_by, from_flow_parameters, load_params, parameter_order
from rlhf_pipeline.tasks.data import validate_data
from rlhf_pipeline.tasks.eval import evaluate
from rlhf_pipeline.tasks.orchestration import retrying
from rlhf_pipeline.tasks.pipeline import pipeline_run
from rlhf_pipeline.tasks.registry import register_task
from rlhf_pipeline.tasks.stages import BY_NAME, pair_readers
from rlhf_pipeline.tasks.training import TASKS, settings_of

DEFAULTS = load_params()  # the embedded preset: what the form and `rlhf run` start from


def _rlhf(**blocks) -> dict:
    """Post-train a model with RLHF: validate data, SFT, reward model, DPO/KTO/GRPO/RLOO/PPO, evaluate, register."""
    params = from_flow_parameters(PipelineParams, blocks)
    with pipeline_run(params) as run:
        stage = retrying(params.retry)
        # Futures wire the DAG (the Prefect UI draws it). Each stage also waits for the one
        # before it, so that only one stage trains on the device at a time.
        futures: dict = {}
        previous = []
        for name in params.plan():
            upstream = {other: futures[other] for other in params.upstream(name)}
            if name == "data":
                data_checks = (params.model, params.token_limits(), pair_readers(params.plan()), params.sft.assistant_only_loss, params.required_columns())
                future = stage(validate_data).submit(params.data, run.ctx, *data_checks)
            elif name == "eval":
                inputs = {"data": upstream["data"], "sft": upstream["sft"], "policy": upstream[params.algorithm], "rm": upstream.get("rm")}
                future = stage(evaluate).submit(params.eval, params.model, inputs, params.registry, run.ctx, wait_for=previous)
            elif name == "registry":
                outputs = [futures[n] for n in params.plan() if n != "registry"]
                future = stage(register_task()).submit(params.gate(), upstream[params.algorithm], upstream["eval"], outputs, run.ctx)
            else:
                settings = {block: getattr(params, block) for block in settings_of(BY_NAME[name]) if block != "feedback"}
                future = stage(TASKS[name]).submit(name, params.config(name), settings, upstream, run.ctx, wait_for=previous)
            futures[name], previous = future, [future]
            if name == params.algorithm:  # feedback rounds: rm samples the last policy and learns its labelled pairs, the policy trains again
                for round_ in range(1, params.feedback.rounds + 1):
                    for again in ("rm", name):
                        if again == "rm":
                            inputs = {"data": futures["data"], "sft": futures["sft"], "policy": futures[name], "rm": futures["rm"]}
                        else:  # from the last round's policy, which is also its KL reference (iterated RLHF), or from SFT again
                            start = futures["sft"] if params.feedback.from_sft else futures[name]
                            inputs = {"data": futures["data"], "sft": start, "rm": futures["rm"]}
                        settings = {block: getattr(params, block) for block in settings_of(BY_NAME[again])}
                        task = stage(TASKS[again]).with_options(task_run_name=f"{again} (round {round_})")
                        future = task.submit(again, params.config(again), settings, inputs, run.ctx, round_, wait_for=previous)
                        futures[again], previous = future, [future]
        built = [futures[n].result() for n in params.plan() if n != "registry"]
        registered = futures["registry"].result() if "registry" in futures else None
        states = {name: future.state.name for name, future in futures.items()}  # Completed, or Cached where the manifest was there
        return run.finish(policy=futures[params.algorithm].result(), report=futures["eval"].result(), stages=built, registered=registered, states=states)


def _signature() -> inspect.Signature:
    """The flow's parameters, one per field of PipelineParams in reading order, defaulting to the embedded preset:
    Prefect reads them (and their types) from the signature to build the typed form."""
    fields = PipelineParams.model_fields
    return inspect.Signature(
        [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(DEFAULTS, name), annotation=fields[name].annotation)
            for name in parameter_order()
        ],
        return_annotation=dict,
    )


_rlhf.__signature__ = _signature()
_rlhf.__name__ = "rlhf"
rlhf = flow(name="rlhf", persist_result=False, validate_parameters=True, log_prints=False)(described_by(PipelineParams)(_rlhf))
