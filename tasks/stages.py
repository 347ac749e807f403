"""Every stage of the pipeline, in one table: the page to open first.

Each row says what a stage is configured by, which code builds it, which of the
`data` stage's datasets it reads, which stages' artifacts it takes and whether
it holds the accelerator while it builds. Everything else is derived from it:
the `algorithm` choices (the rows with `algorithm=True`), `PipelineParams` and
the flow's parameters (one block per row), the flow's wiring, the served
deployments, the device slots, the token limits the data stage checks, and
each stage's code version (the project modules its trainer imports,
`tasks.code_version.code_version`).

A trainer is a module with `train(cfg, ...)`; its parameters are filled by
name (`tasks.training`): `sft_model` / `reward_model` are the upstream `sft` /
`rm` artifacts' model folders, `model` / `rewards` the run's base model and
reward blocks, `data_dir` the data artifact.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_pipeline.tasks.gate import RegistryConfig
from rlhf_pipeline.trainers.config import StrictModel
from rlhf_pipeline.trainers.data import DataConfig
from rlhf_pipeline.trainers.dpo import DpoConfig
from rlhf_pipeline.trainers.eval import EvalConfig
from rlhf_pipeline.trainers.grpo import GrpoConfig
from rlhf_pipeline.trainers.kto import KtoConfig
from rlhf_pipeline.trainers.ppo import PpoConfig
from rlhf_pipeline.trainers.rloo import RlooConfig
from rlhf_pipeline.trainers.rm import RewardModelConfig
from rlhf_pipeline.trainers.sft import SftConfig

POLICY = "policy"
"""In `upstream`: the run's policy-optimisation stage, whichever `algorithm` names."""


@dataclass(frozen=True)
class Stage:
    name: str
    config: type[StrictModel]
    trainer: str | None
    """Module whose `train` builds the stage (None: the stage's task does it all, e.g. registry)."""
    reads: tuple[str, ...]
    """Datasets of the `data` stage it reads; it keys on their digests alone."""
    upstream: tuple[str, ...]
    """Stages whose artifacts it takes (`rm` only where the run's rewards or eval use it)."""
    device: bool
    """Holds a slot of the device limit (a GPU) while it builds."""
    description: str
    algorithm: bool = False
    """One of the policy-optimisation choices (`algorithm=<name>`)."""
    online: bool = False
    """Samples rollouts and scores them with `rewards`."""
    pairs: bool = False
    """Reads preference pairs (chosen/rejected); unpaired rows (completion/label) are refused for it."""


PREFERENCES = ("preference",)
STAGES: tuple[Stage, ...] = (
    Stage("data", DataConfig, "rlhf_pipeline.validators.stage", (), (), False, "Datasets, checked and frozen by the `data` stage."),
    Stage("sft", SftConfig, "rlhf_pipeline.trainers.sft", ("sft",), ("data",), True, "Supervised fine-tuning (TRL SFTTrainer)."),
    Stage(
        "rm",
        RewardModelConfig,
        "rlhf_pipeline.trainers.rm",
        ("preference", "preference_eval"),
        ("data", "sft"),
        True,
        "Reward model (TRL RewardTrainer).",
        pairs=True,
    ),
    Stage("dpo", DpoConfig, "rlhf_pipeline.trainers.dpo", PREFERENCES, ("data", "sft"), True, "DPO (TRL DPOTrainer).", algorithm=True, pairs=True),
    Stage(
        "kto",
        KtoConfig,
        "rlhf_pipeline.trainers.kto",
        PREFERENCES,
        ("data", "sft"),
        True,
        "KTO (TRL KTOTrainer): unpaired binary feedback; pairs are unpaired.",
        algorithm=True,
    ),
    Stage("grpo", GrpoConfig, "rlhf_pipeline.trainers.grpo", ("prompts",), ("data", "sft", "rm"), True, "GRPO (TRL GRPOTrainer).", algorithm=True, online=True),
    Stage("rloo", RlooConfig, "rlhf_pipeline.trainers.rloo", ("prompts",), ("data", "sft", "rm"), True, "RLOO (TRL RLOOTrainer).", algorithm=True, online=True),
    Stage(
        "ppo", PpoConfig, "rlhf_pipeline.trainers.ppo", ("prompts",), ("data", "sft", "rm"), True, "PPO (ours: trainers/ppo.py).", algorithm=True, online=True
    ),
    Stage(
        "eval",
        EvalConfig,
        "rlhf_pipeline.trainers.eval",
        ("prompts_eval", "preference_eval", "sft"),
        ("data", "sft", POLICY, "rm"),
        True,
        "Held-out evaluation of the policy against SFT, the base model and the champion.",
    ),  # fmt: skip
    Stage("registry", RegistryConfig, None, (), (POLICY, "eval"), False, "MLflow model registry and promotion gate."),
)
BY_NAME = {stage.name: stage for stage in STAGES}
ALGORITHMS: tuple[str, ...] = tuple(stage.name for stage in STAGES if stage.algorithm)
DEVICE_STAGES = frozenset(stage.name for stage in STAGES if stage.device)


def reads(stage: str, config: StrictModel) -> tuple[str, ...]:
    """The datasets `stage` reads with this config: the row's, and the held-out ones it evaluates on while training (`held_out`)."""
    return (*BY_NAME[stage].reads, *(name for name in config.held_out() if name not in BY_NAME[stage].reads))


def pair_readers(stages: list[str] | None = None) -> dict[str, tuple[str, ...]]:
    """Dataset -> the stages (of `stages`, default: all) that read it as preference pairs."""
    readers: dict[str, tuple[str, ...]] = {}
    for stage in STAGES:
        if stage.pairs and (stages is None or stage.name in stages):
            for dataset in stage.reads:
                readers[dataset] = (*readers.get(dataset, ()), stage.name)
    return readers
