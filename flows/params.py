"""`PipelineParams`: every stage's config in one typed model, the flow's single parameter.

Presets in `configs/` override the defaults; `--set a.b=value` overrides a preset.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, model_validator
from rlhf_pipeline.tasks.orchestration import RetryConfig
from rlhf_pipeline.tasks.registry import RegistryConfig
from rlhf_pipeline.trainers.common import TINY, ModelConfig, StrictModel
from rlhf_pipeline.trainers.data import DataConfig
from rlhf_pipeline.trainers.dpo import DpoConfig
from rlhf_pipeline.trainers.eval import EvalConfig
from rlhf_pipeline.trainers.grpo import GrpoConfig
from rlhf_pipeline.trainers.ppo import PpoConfig
from rlhf_pipeline.trainers.rewards import RewardsConfig
from rlhf_pipeline.trainers.rloo import RlooConfig
from rlhf_pipeline.trainers.rm import RewardConfig
from rlhf_pipeline.trainers.sft import SftConfig

ONLINE = ("grpo", "rloo", "ppo")

CONFIG_DIR = Path(str(resources.files("rlhf_pipeline.configs")))  # package data: present in a wheel too
DEFAULT_PRESET = "tiny"


class PipelineParams(StrictModel):
    """Everything one run of the `rlhf` flow depends on."""

    algorithm: Literal["dpo", "grpo", "rloo", "ppo"] = Field(
        "dpo", description="Policy-optimisation stage after SFT: offline on preferences (dpo) or online RL against `rewards`."
    )
    preset: str | None = Field(
        DEFAULT_PRESET,
        description="Preset (configs/<name>.yaml or a YAML path) that every field not given here falls back to, "
        "field by field: `-p ppo='{\"kl_coef\": 0.1}'` changes one field of the preset's ppo block.",
    )
    experiment_name: str = Field("rlhf", description="MLflow experiment that holds the runs.")
    no_cache: bool = Field(False, description="Re-run every stage even when its artifact already exists.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The base model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Datasets (checked by the `data` stage).")
    sft: SftConfig = Field(default_factory=SftConfig, description="Supervised fine-tuning (TRL SFTTrainer).")
    rm: RewardConfig = Field(default_factory=RewardConfig, description="Reward model (TRL RewardTrainer).")
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="DPO (TRL DPOTrainer).")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="Rewards of the online stages (grpo, rloo, ppo).")
    grpo: GrpoConfig = Field(default_factory=GrpoConfig, description="GRPO (TRL GRPOTrainer).")
    rloo: RlooConfig = Field(default_factory=RlooConfig, description="RLOO (TRL RLOOTrainer).")
    ppo: PpoConfig = Field(default_factory=PpoConfig, description="PPO (ours: trainers/ppo.py).")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="MLflow model registry and promotion gate.")
    retry: RetryConfig = Field(default_factory=RetryConfig, description="Retries with backoff after transient errors, and a time limit per stage.")

    @model_validator(mode="after")
    def _room_for_prompts(self):
        if self.algorithm in ("grpo", "rloo"):
            online = getattr(self, self.algorithm)
            if online.max_completion_length >= online.max_length:
                raise ValueError(
                    f"{self.algorithm}.max_completion_length={online.max_completion_length} leaves no room for a prompt "
                    f"in {self.algorithm}.max_length={online.max_length}"
                )
        return self

    @model_validator(mode="after")
    def _fits_tiny_model(self):
        if self.model.name_or_path != TINY:
            return self
        limit = self.model.tiny.max_position_embeddings
        for stage in ("sft", "rm", "dpo", "grpo", "rloo"):
            length = getattr(self, stage).max_length
            if length > limit:
                raise ValueError(
                    f"{stage}.max_length={length} exceeds the tiny model's model.tiny.max_position_embeddings={limit}: lower one or raise the other"
                )
        return self

    def token_limits(self) -> dict[str, int]:
        """The most tokens a row of each dataset may take in the stages that read it (the data stage's `fits_max_length`)."""
        limits = {"sft": self.sft.max_length}
        preference = [self.rm.max_length] if self.needs_reward_model else []
        if self.algorithm == "dpo":
            preference.append(self.dpo.max_length)
        if preference:
            limits["preference"] = limits["preference_eval"] = min(preference)
        if self.algorithm in ("grpo", "rloo"):
            online = getattr(self, self.algorithm)
            limits["prompts"] = limits["prompts_eval"] = online.max_length - online.max_completion_length
        return limits

    @property
    def needs_reward_model(self) -> bool:
        """The rm stage runs when evaluation or the online stage's rewards use it."""
        online_uses_it = self.algorithm in ONLINE and self.rewards.uses_reward_model
        return online_uses_it or self.eval.use_reward_model


def preset_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_file():
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
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def load_params(preset: str | None = DEFAULT_PRESET, overrides: list[str] = (), **fields: Any) -> PipelineParams:
    """Defaults < preset (YAML) < `--set` overrides < keyword fields."""
    return PipelineParams.model_validate(deep_merge(apply_overrides(preset_values(preset), overrides), fields))


def preset_values(preset: str | None) -> dict[str, Any]:
    values = yaml.safe_load(preset_path(preset).read_text()) if preset else None
    return {**(values or {}), "preset": preset}


Params = TypeVar("Params", bound=StrictModel)


def from_flow_parameters(model: type[Params], given: dict[str, Any]) -> Params:
    """The flow's parameters as one typed model, each block merged field by field onto the preset.

    Prefect merges a run's parameters onto its deployment's per top-level name,
    so `-p ppo='{"kl_coef": 0.1}'` arrives as a PpoConfig with one field set;
    the fields it leaves unset come from the preset, not from the code defaults.
    """
    explicit = {name: value.model_dump(mode="json", exclude_unset=True) if isinstance(value, BaseModel) else value for name, value in given.items()}
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
