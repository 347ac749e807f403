"""`PipelineParams`: the run's settings plus one typed block per row of the table of stages (`tasks.stages`).

Presets in `configs/` override the defaults (and may `extends:` another preset);
`--set a.b=value` overrides a preset; the flow's parameters are these fields.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator

from rlhf_pipeline.flows.ownership import check_owned
from rlhf_pipeline.flows.plan import check_adapter_handoff, pairs_feed, stages
from rlhf_pipeline.tasks.config import LaunchConfig, RetryConfig, check_name
from rlhf_pipeline.tasks.gate import RegistryConfig
from rlhf_pipeline.tasks.stages import ALGORITHMS, BY_NAME, STAGES, reads
from rlhf_pipeline.trainers.algorithms.dpo import DpoConfig
from rlhf_pipeline.trainers.algorithms.grpo import GrpoConfig
from rlhf_pipeline.trainers.algorithms.kto import KtoConfig
from rlhf_pipeline.trainers.algorithms.orpo import OrpoConfig
from rlhf_pipeline.trainers.algorithms.rloo import RlooConfig
from rlhf_pipeline.trainers.algorithms.rm import RewardModelConfig
from rlhf_pipeline.trainers.algorithms.sft import SftConfig
from rlhf_pipeline.trainers.config import TINY, ModelConfig, StrictModel
from rlhf_pipeline.trainers.data import DataConfig
from rlhf_pipeline.trainers.evaluation.stage import EvalConfig
from rlhf_pipeline.trainers.pairs.feedback import FeedbackConfig
from rlhf_pipeline.trainers.pairs.stage import PairsConfig
from rlhf_pipeline.trainers.ppo.config import PpoConfig
from rlhf_pipeline.trainers.rewards.mix import GoldMetric, RewardsConfig
from rlhf_pipeline.trainers.runtime.trust import check_path

CONFIG_DIR = Path(str(resources.files("rlhf_pipeline.configs")))  # package data: present in a wheel too
DEFAULT_PRESET = "tiny"

Algorithm = Literal[ALGORITHMS]  # the table's policy-optimisation rows: dpo, grpo, rloo, ppo, ...


class RunSettings(StrictModel):
    """The blocks of a run that are not stages; `PipelineParams` adds one block per stage of the table."""

    algorithm: Algorithm = Field(
        "dpo",
        description="Policy-optimisation stage after SFT: offline on preferences "
        f"({', '.join(s.name for s in STAGES if s.algorithm and not s.online)}) or online RL against `rewards` "
        f"({', '.join(s.name for s in STAGES if s.online)}).",
    )
    preset: str | None = Field(
        DEFAULT_PRESET,
        description="Preset (`configs/<name>.yaml` or a YAML path) that every field not given here falls back to, "
        "field by field: `-p ppo='{\"kl_coef\": 0.1}'` changes one field of the preset's ppo block.",
    )
    experiment_name: str = Field("rlhf", description="MLflow experiment that holds the runs.")

    @field_validator("experiment_name")
    @classmethod
    def _holdable_name(cls, name: str) -> str:
        return check_name(name, "experiment_name")

    no_cache: bool = Field(False, description="Re-run every stage even when its artifact already exists.")
    overrides: list[str] = Field(
        default_factory=list,
        description="Any other field, as the command line's `--set KEY=VALUE` (`sft.learning_rate=1e-4`, "
        "`data.preference.split=test`), applied over the blocks; `rlhf params --explain KEY` describes a field.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The base model.")
    rewards: RewardsConfig = Field(
        default_factory=RewardsConfig, description="Rewards of the online stages (grpo, rloo, ppo)."
    )
    feedback: FeedbackConfig = Field(
        default_factory=FeedbackConfig,
        description="Iterated feedback after the policy stage: sample the policy, label pairs (the pairs block's "
        "labeller), train again (rounds).",
    )
    retry: RetryConfig = Field(
        default_factory=RetryConfig,
        description="Retries with backoff after transient errors, and a time limit per stage.",
    )
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig,
        description="Where training stages run: in the flow run's process or under accelerate (DDP, DeepSpeed, FSDP2).",
    )

    def config(self, stage: str) -> Any:
        """The block of `stage`: an instance of its row's config class (`tasks.stages`)."""
        return getattr(self, stage)

    def setting(self, block: str, stage: str) -> Any:
        """A run-level block `stage`'s trainer takes (`tasks.training.SETTINGS`): `model`, `rewards`, and `gold`, the
        held-out gold metric of eval that the stage's probes score and keep_best chooses by (empty where the stage
        does not probe, so eval's gold metric keys only the stages that use it)."""
        if block == "gold":
            probes = self.config(stage).evaluates
            return GoldMetric(function=self.config("eval").gold_metric if probes else None)
        return getattr(self, block)

    @model_validator(mode="after")
    def _feedback_rounds_possible(self):
        """Feedback rounds label the last policy's samples (the `pairs` block's labeller) and train on the pairs:
        through the reward model an online algorithm optimises, or directly (dpo, kto, orpo)."""
        rounds = self.feedback.rounds
        if not rounds:
            return self
        online = BY_NAME[self.algorithm].online
        if online and not self.rewards.uses_reward_model:
            raise ValueError(
                f"feedback.rounds={rounds} trains on labelled pairs of the policy's samples, and "
                f"algorithm={self.algorithm} optimises rewards.functions alone (reward_model_weight=0), which no "
                "pair changes: use an offline algorithm (dpo, kto, orpo) or rewards.reward_model_weight > 0"
            )
        if online and self.config("pairs").labeller == "reward_model":
            raise ValueError(
                f"feedback.rounds={rounds} retrains the reward model on the labelled pairs: it cannot label them "
                "itself (pairs.labeller=reward_model); choose a function, a judge or people"
            )
        self.config("pairs").check_labeller(f"feedback.rounds={rounds}")
        if self.config("data").prompts is None:
            raise ValueError(f"data.prompts is null and feedback.rounds={rounds} samples the policy on it: name it")
        return self

    def token_limits(self) -> dict[str, int]:
        """The most tokens a row of each dataset may take in the stages of this run that read it (the data stage's
        `fits_max_length`)."""
        limits: dict[str, int] = {}
        for stage in stages(self):
            limit = self.config(stage).row_token_limit()
            for dataset in reads(stage, self.config(stage)) if limit is not None else ():
                limits[dataset] = min(limit, limits.get(dataset, limit))
        return limits

    @model_validator(mode="after")
    def _room_for_prompts(self):
        """A prompt budget of zero tokens is a config error, shown with the numbers, not a data error."""
        online = self.config(self.algorithm)
        if hasattr(online, "max_completion_length") and online.max_completion_length >= online.max_length:
            raise ValueError(
                f"{self.algorithm}.max_completion_length={online.max_completion_length} leaves no room for a prompt "
                f"in {self.algorithm}.max_length={online.max_length}"
            )
        return self

    @model_validator(mode="after")
    def _adapter_handoff_chosen(self):
        check_adapter_handoff(self)
        return self

    @model_validator(mode="after")
    def _held_out_data_given(self):
        """A stage that evaluates while it trains needs its held-out dataset in the data block."""
        given = self.config("data").sources()
        for stage in stages(self):
            for dataset in self.config(stage).held_out() if self.config(stage).evaluates else ():
                if dataset not in given:
                    hint = f"set data.{dataset}" + self.config(stage).data_hint(dataset)
                    setting = (
                        f"eval_strategy={self.config(stage).eval_strategy!r}"
                        if hasattr(self.config(stage), "eval_strategy")
                        else f"eval_steps={self.config(stage).eval_steps}"
                    )
                    raise ValueError(
                        f"{stage}.{setting} evaluates on the {dataset} dataset, which data does not name: {hint}"
                    )
        return self

    def eval_metrics(self) -> set[str]:
        """The metrics this run's eval will report, decided from the parameters and the held-out prompts' columns
        (a hub dataset's columns are unknown here: it is assumed to have the reference column only if eval names
        one)."""
        from rlhf_pipeline.trainers.data import peek_columns
        from rlhf_pipeline.trainers.evaluation.stage import planned_metrics

        cfg, data = self.config("eval"), self.config("data")
        columns = peek_columns(data.prompts_eval)
        has_reference = cfg.answer_column is not None and (columns is None or cfg.answer_column in columns)
        return planned_metrics(
            cfg,
            has_reference=has_reference,
            reward_model=cfg.use_reward_model,
            preference_eval=data.preference_eval is not None,
            ensemble=self.config("rm").ensemble_size,
            sft_trained=self.config("sft").enabled,
            demonstrations=data.sft is not None,
        )

    @model_validator(mode="after")
    def _datasets_named(self):
        """Every dataset a stage of this run reads is named (sft switched off reads none; a run without rm or an
        offline algorithm reads no preference pairs)."""
        data = self.config("data")
        for stage in stages(self):
            made = pairs_feed(self, stage) and self.config("pairs").train_on == "made"
            for dataset in reads(stage, self.config(stage)):
                if dataset == "preference" and made:
                    continue  # it trains on the pairs the `pairs` stage makes
                if dataset not in OPTIONAL_READS.get(stage, ()) and getattr(data, dataset, None) is None:
                    hint = self.config(stage).data_hint(dataset)
                    raise ValueError(f"data.{dataset} is null and {stage} reads it: name the dataset{hint}")
        return self

    @model_validator(mode="after")
    def _gate_metric_measured(self):
        """A gate on a metric eval will not report would refuse every candidate after the whole run: fail now."""
        if not self.config("registry").enabled:
            return self
        import math

        planned = self.eval_metrics()
        registry = self.config("registry").resolved(planned)
        if registry.gate_metric in planned and (
            not math.isfinite(registry.min_lower_bound) or f"{registry.gate_metric}_low" in planned
        ):
            return self
        cfg, spec = self.config("eval"), self.config("data").prompts_eval
        why = []
        if "exact_match" in registry.gate_metric:
            why.append(
                f"exact match needs reference answers, and {spec.path} has no column {cfg.answer_column!r} "
                "(eval.answer_column)"
            )
        if "win_rate" in registry.gate_metric and not cfg.use_reward_model:
            why.append("win rates are judged by the reward model, and eval.use_reward_model is false")
        if "_gold" in registry.gate_metric and cfg.gold_metric is None:
            why.append("no eval.gold_metric is named")
        if registry.gate_metric in planned:
            why.append(f"it has no confidence bound {registry.gate_metric}_low: set registry.min_lower_bound=-.inf")
        candidates = sorted(
            n
            for n in planned
            if not n.endswith(("_low", "_high"))
            and ("win_rate" in n or "gain" in n or n.endswith(("_exact_match", "_gold")))
        )
        raise ValueError(
            f"registry.gate_metric={registry.gate_metric!r} is not a metric this run's eval reports"
            + (f" ({'; '.join(why)})" if why else "")
            + "; it reports e.g. "
            + (
                ", ".join(candidates)
                or "no comparable metric: enable eval.use_reward_model or name an eval.gold_metric"
            )
        )

    def benchmarks(self) -> tuple[str, ...]:
        """The benchmarks eval scores (IFEval, IFBench), whose test prompts the data stage keeps out of training."""
        following = self.config("eval").instruction_following
        if following is None:
            return ()
        from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS

        return tuple(key for key in BENCHMARKS if following.prompts(key) > 0)

    def required_columns(self) -> dict[str, tuple[str, ...]]:
        """Columns the data stage must find because the gate reads a metric made from them (checked there for a hub
        dataset, whose columns the parameters cannot see)."""
        registry, cfg = self.config("registry"), self.config("eval")
        if (
            registry.enabled
            and cfg.answer_column
            and cfg.gold_metric is None
            and "exact_match" in self.gate().gate_metric
        ):
            return {"prompts_eval": (cfg.answer_column,)}
        return {}

    def gate(self):
        """The registry block with its gate made concrete for this run (`RegistryConfig.resolved`)."""
        return self.config("registry").resolved(self.eval_metrics())

    @model_validator(mode="after")
    def _owned_by_the_operator(self):
        check_owned(self)  # clusters, files and code: the worker's settings decide (flows/ownership.py)
        return self

    @model_validator(mode="after")
    def _fits_tiny_model(self):
        if self.model.name_or_path != TINY:
            return self
        limit = self.model.tiny.max_position_embeddings
        for stage in STAGES:
            length = self.config(stage.name).longest_sequence()
            if length is not None and length > limit:
                raise ValueError(
                    f"{stage.name}.max_length={length} exceeds the tiny model's "
                    f"model.tiny.max_position_embeddings={limit}: lower one or raise the other"
                )
        return self


OPTIONAL_READS = {"eval": ("sft", "preference_eval"), "rm": ("preference_eval",), "sft": ("sft_eval",)}
"""Datasets a stage reads only when they are named: eval's perplexity rows and held-out pairs, rm's held-out pairs
(sft's held-out set is checked by `_held_out_data_given`)."""


def _block(name: str):
    """A stage's block, as the table's row describes it."""
    row = BY_NAME[name]
    return Field(default_factory=row.config, description=row.description)


class PipelineParams(RunSettings):
    """Everything one run of the `rlhf` flow depends on: the run's settings and one block per stage of the table
    (`tasks.stages.STAGES`, in its order; `tests/flows/test_params.py` checks that they agree)."""

    @model_validator(mode="wrap")
    @classmethod
    def _overrides_applied(cls, values: Any, handler) -> PipelineParams:
        """`overrides` (the UI form's way to every field it does not show) set their fields on the whole parameters, as
        `--set` does; the result is checked again."""
        made = handler(values)
        if not made.overrides:
            return made
        return handler(
            {**apply_overrides(made.model_dump(exclude={"overrides"}), made.overrides), "overrides": made.overrides}
        )

    data: DataConfig = _block("data")
    sft: SftConfig = _block("sft")
    pairs: PairsConfig = _block("pairs")
    rm: RewardModelConfig = _block("rm")
    dpo: DpoConfig = _block("dpo")
    kto: KtoConfig = _block("kto")
    orpo: OrpoConfig = _block("orpo")
    grpo: GrpoConfig = _block("grpo")
    rloo: RlooConfig = _block("rloo")
    ppo: PpoConfig = _block("ppo")
    eval: EvalConfig = _block("eval")
    registry: RegistryConfig = _block("registry")


def parameter_order() -> list[str]:
    """The flow's parameters as a person reads them: the run's settings, then the stages in pipeline order
    (`rewards` just before the first online stage, `feedback` after the last algorithm), then `retry` and `launch`."""
    order = ["algorithm", "preset", "experiment_name", "no_cache", "overrides", "model"]
    for stage in STAGES:
        if stage.online and "rewards" not in order:
            order.append("rewards")
        order.append(stage.name)
        if stage.name == ALGORITHMS[-1]:  # feedback rounds train the algorithm again
            order.append("feedback")
    return [*order, "retry", "launch"]


def preset_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        check_path(path, f"preset {preset!r}", (CONFIG_DIR.resolve(),))  # read before the parameters are checked
        return path
    named = CONFIG_DIR / f"{preset}.yaml"
    if not named.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"unknown preset {preset!r}: not a YAML file, nor a preset of {CONFIG_DIR} ({known})")
    return named


def parse_override(item: str) -> tuple[list[str], Any]:
    """'sft.learning_rate=1e-4' -> (['sft', 'learning_rate'], 1e-4); values are YAML."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected key.path=value, e.g. sft.learning_rate=1e-4")
    key, raw = item.split("=", 1)
    return key.strip().split("."), read_yaml(raw, f"--set {item!r}") if raw.strip() else ""


def deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = (
            deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def load_params(preset: str | None = DEFAULT_PRESET, overrides: list[str] = (), **fields: Any) -> PipelineParams:
    """Defaults < preset (YAML) < `--set` overrides < keyword fields."""
    return PipelineParams.model_validate(deep_merge(apply_overrides(preset_values(preset), overrides), fields))


def preset_values(preset: str | None, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """A preset's values; `extends: <preset>` starts from another one, so a preset lists only what it changes."""
    if not preset:
        return {"preset": preset}
    if preset in chain:
        raise ValueError(f"preset {preset!r}: {' extends '.join([*chain, preset])}, a cycle")
    path = preset_path(preset)
    values = read_yaml(path.read_text(encoding="utf-8", errors="replace"), f"preset {path}") or {}
    if not isinstance(values, dict):
        raise ValueError(f"preset {path}: a preset is a mapping of blocks and fields, not a {type(values).__name__}")
    if "extends" in values:
        parent = values.pop("extends")
        if not isinstance(parent, str):
            raise ValueError(f"preset {path}: extends names one preset, got {parent!r}")
        values = deep_merge(preset_values(parent, (*chain, preset)), values)
    return {**values, "preset": preset}


def read_yaml(text: str, where: str) -> Any:
    """`text` as YAML's plain data (no tags: nothing is constructed), or ValueError naming `where`, the line and the
    column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{where}{at}: not valid YAML ({problem})") from None


Params = TypeVar("Params", bound=StrictModel)
BM = TypeVar("BM", bound=BaseModel)


def as_default(block: BM) -> BM:
    """`block` as a flow parameter's default: the same values with no field marked as given, so that
    `from_flow_parameters` takes every field from the run's preset (a preset other than the one the defaults were
    read from must not lose to them)."""
    return type(block).model_construct(_fields_set=set(), **dict(block))


def from_flow_parameters(model: type[Params], given: dict[str, Any]) -> Params:
    """The flow's parameters as one typed model, each block merged field by field onto the preset.

    Prefect merges a run's parameters onto its deployment's per top-level name,
    so `-p ppo='{"kl_coef": 0.1}'` arrives as a PpoConfig with one field set;
    the fields it leaves unset come from the preset, not from the code defaults.
    """
    explicit = {
        name: value.model_dump(mode="json", exclude_unset=True) if isinstance(value, BaseModel) else value
        for name, value in given.items()
    }
    preset = preset_values(given.get("preset")) if "preset" in model.model_fields else {}
    base = {name: value for name, value in preset.items() if name in model.model_fields}
    return model.model_validate(deep_merge(base, explicit))


def described_by(model: type[StrictModel]) -> Callable[[Callable], Callable]:
    """Add the model's field descriptions to a flow function's docstring as `Args:`.

    Prefect reads parameter descriptions from the docstring, and the UI shows
    them on the run form; this keeps one copy of them, on the model.
    """

    def describe(fn: Callable) -> Callable:
        args = "\n".join(f"    {name}: {field.description}" for name, field in model.model_fields.items())
        fn.__doc__ = f"{fn.__doc__.rstrip()}\n\nArgs:\n{args}\n"
        return fn

    return describe


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Merge `--set key.path=value` items into a nested dict of parameters."""
    for item in overrides:
        path, value = parse_override(item)
        nested: Any = value
        for part in reversed(path):
            nested = {part: nested}
        values = deep_merge(values, nested)
    return values
