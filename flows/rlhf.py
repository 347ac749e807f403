"""The `rlhf` flow: data -> sft -> pairs -> rm -> the policy stage (`algorithm`) -> eval -> registry, as straight-line
calls (pairs only when it is on; after rm when the reward model labels them).

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
from rlhf_pipeline.tasks.orchestration.parent_run import pipeline_run, preset_label, report_failure
from rlhf_pipeline.tasks.orchestration.stage_task import retrying
from rlhf_pipeline.tasks.pairs import labels_store, make_pairs
from rlhf_pipeline.tasks.people import ask_people
from rlhf_pipeline.tasks.registry import register_task
from rlhf_pipeline.tasks.stages import BY_NAME, pair_readers
from rlhf_pipeline.tasks.training import TASKS, settings_of

DEFAULTS = load_params()  # the embedded preset: what the form and `rlhf run` start from


def _rlhf(**blocks) -> dict:
    """Post-train a model with RLHF: validate data, SFT, reward model, policy optimisation, evaluate, register."""
    params = from_flow_parameters(PipelineParams, blocks)
    plan = params.plan()
    with pipeline_run(params) as run:
        task = retrying(params.retry)
        built: dict = {}  # stage -> its future: the arguments wire the DAG the Prefect UI draws

        def train(stage: str, after, inputs: dict | None = None, round_: int = 0):
            """Submit one training stage; it waits for the stage before it, so one stage trains on the device at a
            time."""
            inputs = inputs or {name: built[name] for name in params.upstream(stage)}
            settings = {block: params.setting(block, stage) for block in settings_of(BY_NAME[stage])}
            stage_task = task(TASKS[stage])
            if round_:
                stage_task = stage_task.with_options(task_run_name=f"{stage} (round {round_})")
            built[stage] = stage_task.submit(
                stage, params.config(stage), settings, inputs, run.ctx, *([round_] if round_ else []), wait_for=[after]
            )
            return built[stage]

        data = built["data"] = task(validate_data).submit(
            params.data,
            run.ctx,
            params.model,
            params.token_limits(),
            pair_readers(plan),
            params.sft.assistant_only_loss,
            params.required_columns(),
            params.benchmarks(),
        )

        def make_pairs_from(after, inputs: dict | None = None, round_: int = 0, earlier=None):
            """Submit the pairs stage; with people as the labeller, wait for them here in the flow (no task holds a
            device slot meanwhile), then label the cached samples."""
            inputs = inputs or {name: built[name] for name in params.upstream("pairs")}
            arguments = (params.pairs, inputs, run.ctx, round_, params.rewards.reward_model_aggregate, earlier)
            name = f"pairs (round {round_})" if round_ else "pairs"
            made = task(make_pairs).with_options(task_run_name=name).submit(*arguments, wait_for=[after])
            made.wait()
            if made.state.name == "AwaitingLabels":
                samples = made.result()
                ask_people(samples, labels_store(run.ctx, samples.key), params.pairs.people)
                made = task(make_pairs).with_options(task_run_name=f"{name} labelled").submit(*arguments)
            built["pairs"] = made
            return made

        sft = train("sft", after=data)
        labels_with_rm = params.pairs.labeller == "reward_model"
        first_pairs = params.makes_pairs and not labels_with_rm
        pairs = make_pairs_from(after=sft) if first_pairs else None
        rm = train("rm", after=pairs or sft) if "rm" in plan else None
        if params.makes_pairs and labels_with_rm:  # the reward model labels: it trains first, on the given pairs
            pairs = make_pairs_from(after=rm)
        policy = train(params.algorithm, after=pairs or rm or sft)
        # Feedback rounds (trainers/pairs/feedback.py): pairs from the last policy's samples, then rm and an online
        # policy against it, or an offline policy on the pairs; from SFT or from the last round's policy (then also its
        # KL reference: iterated RLHF).
        online = BY_NAME[params.algorithm].online
        for round_ in range(1, params.feedback.rounds + 1):
            earlier = built.get("pairs") if params.feedback.keep_pairs else None
            made = make_pairs_from(
                after=policy,
                inputs={"data": data, "sft": sft, "policy": policy, **({"rm": rm} if labels_with_rm else {})},
                round_=round_,
                earlier=earlier,
            )
            start = sft if params.feedback.from_sft else policy
            if online:
                rm = train("rm", after=made, inputs={"data": data, "sft": sft, "pairs": made}, round_=round_)
                inputs = {"data": data, "sft": start, "rm": rm}
            else:
                inputs = {"data": data, "sft": start, "pairs": made}
            policy = train(params.algorithm, after=made if not online else rm, inputs=inputs, round_=round_)
        evaluated = {
            "data": data,
            "sft": sft,
            "policy": policy,
            "rm": rm if "rm" in params.upstream("eval") else None,
            "pairs": built.get("pairs"),
        }
        report = built["eval"] = task(evaluate).submit(
            params.eval, params.model, evaluated, params.registry, run.ctx, wait_for=[policy]
        )
        outputs = [built[name] for name in plan if name in built]
        registered = (
            task(register_task()).submit(params.gate(), policy, report, outputs, run.ctx)
            if "registry" in plan
            else None
        )
        if registered is not None:
            built["registry"] = registered
        stages = [future.result() for name, future in built.items() if name != "registry"]
        decision = registered.result() if registered is not None else None
        states = {
            name: future.state.name for name, future in built.items()
        }  # Completed, or Cached where the manifest was there
        return run.finish(
            policy=policy.result(), report=report.result(), stages=stages, registered=decision, states=states
        )


def _signature() -> inspect.Signature:
    """The flow's parameters, one per field of PipelineParams in reading order, defaulting to the embedded preset:
    Prefect reads them (and their types) from the signature to build the typed form."""
    fields = PipelineParams.model_fields
    return inspect.Signature(
        [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=getattr(DEFAULTS, name),
                annotation=fields[name].annotation,
            )
            for name in parameter_order()
        ],
        return_annotation=dict,
    )


def run_name() -> str:
    """The flow run's name, also its MLflow parent run's: what runs, `<algorithm>-<preset>` (`ppo-tiny`, `dpo-ci`).
    Prefect 3.9.1 allows equal names; runs differ by id and start time."""
    from prefect.runtime import flow_run

    algorithm, preset = (flow_run.parameters.get(name, getattr(DEFAULTS, name)) for name in ("algorithm", "preset"))
    return f"{algorithm}-{preset_label(preset)}"


_rlhf.__signature__ = _signature()  # type: ignore[attr-defined]  # what inspect (and Prefect) read
# Served deployments load their flow by the function's qualified name: it must name the flow object below (`_rlhf`
# would load as a plain function that Prefect wraps in a default flow: no run name, hooks or flow settings).
_rlhf.__name__ = _rlhf.__qualname__ = "rlhf"
rlhf = flow(
    name="rlhf",
    flow_run_name=run_name,
    persist_result=False,
    validate_parameters=True,
    log_prints=False,
    on_failure=[report_failure],  # name the MLflow run and the state folder
    on_crashed=[report_failure],
)(described_by(PipelineParams)(_rlhf))
