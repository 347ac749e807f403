"""The `rlhf` flow: the steps of the run's plan (flows/plan.py: data -> sft -> pairs -> rm -> the policy stage
(`algorithm`) -> feedback rounds -> eval -> registry, each where the parameters call for it), submitted in order.

    rlhf run [--config PRESET] [--set key.path=value ...] [--no-cache]
    prefect deployment run rlhf/full -p algorithm=grpo -p grpo='{"beta": 0.1}'

Its parameters are the fields of `PipelineParams`, one block per stage of
`tasks.stages.STAGES` plus the run's settings, so a deployment run can override
a block (or one field of it: blocks merge onto the preset) and the Prefect UI
draws one typed section per stage.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from prefect import flow

from rlhf_pipeline.flows.params import PipelineParams, described_by, from_flow_parameters, load_params, parameter_order
from rlhf_pipeline.flows.plan import Step, last_policy_and_report, plan, stages
from rlhf_pipeline.tasks.data import validate_data
from rlhf_pipeline.tasks.eval import evaluate
from rlhf_pipeline.tasks.labels import labels_store
from rlhf_pipeline.tasks.orchestration.parent_run import pipeline_run, preset_label, report_failure
from rlhf_pipeline.tasks.orchestration.stage_task import retrying, stage_runner
from rlhf_pipeline.tasks.pairs import make_pairs
from rlhf_pipeline.tasks.people import ask_people
from rlhf_pipeline.tasks.registry import register_task
from rlhf_pipeline.tasks.stages import BY_NAME, pair_readers
from rlhf_pipeline.tasks.store.artifacts import RunContext
from rlhf_pipeline.tasks.training import TASKS, settings_of

DEFAULTS = load_params()  # the embedded preset: what the form and `rlhf run` start from


def _rlhf(**blocks) -> dict:
    """Post-train a model with RLHF: validate data, SFT, reward model, policy optimisation, evaluate, register."""
    params = from_flow_parameters(PipelineParams, blocks)
    steps = plan(params)
    with pipeline_run(params) as run:
        submitting = Submitting(params, run.ctx, retrying(params.retry))
        built: dict = {}  # stage -> its last step's future
        for step in steps:
            # The arguments wire the DAG the Prefect UI draws.
            inputs = {name: submitting.futures[source] for name, source in step.inputs.items()}
            submit = SUBMIT[BY_NAME[step.stage].builds_with]
            submitting.futures[step.name] = built[step.stage] = submit(step, inputs, submitting)
        policy, report = (submitting.futures[name] for name in last_policy_and_report(steps))
        # Results in step order: the first stage that failed raises its own error (those after it never ran).
        stages = [future.result() for stage, future in built.items() if BY_NAME[stage].code]  # keyed artifacts
        registered = [future.result() for stage, future in built.items() if not BY_NAME[stage].code]
        return run.finish(
            policy=policy.result(),
            report=report.result(),
            stages=stages,
            registered=registered[0] if registered else None,
            # Completed, or Cached where the manifest was there
            states={stage: future.state.name for stage, future in built.items()},
        )


@dataclass
class Submitting:
    """What every step of a run is submitted with: the run's parameters and context, its stage task factory, and the
    futures of the steps submitted so far (by step name)."""

    params: PipelineParams
    ctx: RunContext
    task: Callable
    futures: dict = field(default_factory=dict)


def _data(step: Step, inputs: dict, run: Submitting):
    arguments = (
        run.params.data,
        run.ctx,
        run.params.model,
        run.params.token_limits(),
        pair_readers(stages(run.params)),
    )
    more = (run.params.sft.assistant_only_loss, run.params.required_columns(), run.params.benchmarks())
    return run.task(validate_data).submit(*arguments, *more)


def _train(step: Step, inputs: dict, run: Submitting):
    """A training stage; it waits for the step before it, so one stage trains on the device at a time."""
    settings = {block: run.params.setting(block, step.stage) for block in settings_of(BY_NAME[step.stage])}
    stage_task = run.task(TASKS[step.stage])
    if step.round:
        stage_task = stage_task.with_options(task_run_name=f"{step.stage} (round {step.round})")
    arguments = (
        step.stage,
        run.params.config(step.stage),
        settings,
        inputs,
        run.ctx,
        *([step.round] if step.round else []),
    )
    return stage_task.submit(*arguments, wait_for=[run.futures[step.after]])


def _pairs(step: Step, inputs: dict, run: Submitting):
    """The pairs stage; with people as the labeller, wait for them here in the flow (no task holds a device slot
    meanwhile), then label the cached samples."""
    earlier = run.futures[step.keep] if step.keep else None
    arguments = (run.params.pairs, inputs, run.ctx, step.round, run.params.rewards.reward_model_aggregate, earlier)
    name = f"pairs (round {step.round})" if step.round else "pairs"
    made = run.task(make_pairs).with_options(task_run_name=name).submit(*arguments, wait_for=[run.futures[step.after]])
    made.wait()
    if made.state.name == "AwaitingLabels":
        samples = made.result()
        ask_people(samples, labels_store(run.ctx.artifact_root, samples.key), run.params.pairs.people)
        made = run.task(make_pairs).with_options(task_run_name=f"{name} labelled").submit(*arguments)
    return made


def _evaluate(step: Step, inputs: dict, run: Submitting):
    arguments = (run.params.eval, run.params.model, inputs, run.params.registry, run.ctx)
    return run.task(evaluate).submit(*arguments, wait_for=[run.futures[step.after]])


def _register(step: Step, inputs: dict, run: Submitting):
    outputs = [future for name, future in inputs.items() if name not in ("policy", "report")]
    return run.task(register_task()).submit(run.params.gate(), inputs["policy"], inputs["report"], outputs, run.ctx)


SUBMIT = {"train": _train, "data": _data, "pairs": _pairs, "eval": _evaluate, "registry": _register}
"""How the flow submits each kind of task of the table (`Stage.builds_with`)."""


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
    """The flow run's name, also its MLflow parent run's: the name a person gave it (the UI's Run Name, `prefect
    deployment run --flow-run-name`), else what runs and which run it is, `<algorithm>-<preset>-<flow run id's first 6
    characters>` (`ppo-tiny-3f9a2c`, `dpo-ci-81b0d4`), in place of the adjective-animal name Prefect gives an unnamed
    run."""
    from prefect.runtime import flow_run

    given = flow_run.name
    if given and not prefect_made(given):
        return given
    algorithm, preset = (flow_run.parameters.get(name, getattr(DEFAULTS, name)) for name in ("algorithm", "preset"))
    return f"{algorithm}-{preset_label(preset)}-{str(flow_run.id)[:6]}"


def prefect_made(name: str) -> bool:
    """Whether `name` is one Prefect makes for an unnamed run: two words of coolname's adjectives and animals
    (`prefect.utilities.names.generate_slug(2)`: 'free-bittern')."""
    import coolname

    words = name.split("-")
    try:  # coolname's two-word list is the product of its adjectives and its animals (coolname is locked)
        adjectives, animals = coolname._default._lists[2]._lists[0]._lists  # type: ignore[attr-defined]
    except (AttributeError, KeyError, IndexError, ValueError):  # another coolname: the slug's shape alone
        return len(words) == 2 and all(word.isalpha() and word.islower() for word in words)
    return len(words) == 2 and words[0] in adjectives and words[1] in animals


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
    task_runner=stage_runner(),  # every stage on one thread
    on_failure=[report_failure],  # name the MLflow run and the state folder
    on_crashed=[report_failure],
)(described_by(PipelineParams)(_rlhf))
