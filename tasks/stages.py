"""Every stage of the pipeline, in one table: the page to open first (docs/ARCHITECTURE.md, "Stages and the table").

Each row says what a stage is configured by, which code builds it (the module itself) and which task runs it, which of
the `data` stage's datasets it reads, which stages' artifacts it takes, whether it holds the accelerator while it builds
and which models it holds there. Everything else is derived from it: the `algorithm` choices, `PipelineParams` and the
flow's parameters (one block per row), the served deployments, the device slots, the token limits the data stage checks,
the memory `rlhf check` estimates, and each stage's code version (the project modules its `code` imports,
`tasks.store.code_version`). The trainer contract (what `train(cfg, ...)` is given) is in `tasks.training`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

from rlhf_pipeline.tasks.gate import RegistryConfig
from rlhf_pipeline.trainers.algorithms import dpo, grpo, kto, orpo, rloo, rm, sft
from rlhf_pipeline.trainers.algorithms.dpo import DpoConfig
from rlhf_pipeline.trainers.algorithms.grpo import GrpoConfig
from rlhf_pipeline.trainers.algorithms.kto import KtoConfig
from rlhf_pipeline.trainers.algorithms.orpo import OrpoConfig
from rlhf_pipeline.trainers.algorithms.rloo import RlooConfig
from rlhf_pipeline.trainers.algorithms.rm import RewardModelConfig
from rlhf_pipeline.trainers.algorithms.sft import SftConfig
from rlhf_pipeline.trainers.config import StageConfig
from rlhf_pipeline.trainers.data import DataConfig
from rlhf_pipeline.trainers.evaluation import stage as evaluation
from rlhf_pipeline.trainers.evaluation.stage import EvalConfig
from rlhf_pipeline.trainers.models.memory import (
    EVALUATED,
    POLICY,
    REFERENCE,
    REWARD_MODEL,
    SAMPLING,
    TRAINED_REWARD_MODEL,
    VALUE_MODEL,
    Held,
)
from rlhf_pipeline.trainers.pairs import stage as pairs_stage
from rlhf_pipeline.trainers.pairs.stage import PairsConfig
from rlhf_pipeline.trainers.ppo import train as ppo
from rlhf_pipeline.trainers.ppo.config import PpoConfig
from rlhf_pipeline.validators import stage as data_stage

POLICY_STAGE = "policy"
"""In `upstream`: the run's policy-optimisation stage, whichever `algorithm` names."""
Builds = Literal["train", "data", "pairs", "eval", "registry"]
"""Which task builds a stage: `train`, the one task of every stage whose code has the contract's `train`
(`tasks.training`); or a task of its own (`tasks.data`, `tasks.pairs`, `tasks.eval`, `tasks.registry`)."""


@dataclass(frozen=True, kw_only=True)
class Stage:
    name: str
    config: type[StageConfig]
    code: ModuleType | None
    """The module whose source and imports are the stage's code version; built with `train`, its `train` builds the
    stage (None: the stage is not keyed, e.g. registry)."""
    builds_with: Builds
    """The task that builds it (the flow submits each kind its own way, flows/rlhf.py)."""
    description: str
    reads: tuple[str, ...] = ()
    """Datasets of the `data` stage it reads; it keys on their digests alone."""
    upstream: tuple[str, ...] = ()
    """Stages whose artifacts it takes (`rm` only where the run's rewards or eval use it)."""
    device: bool = False
    """Holds a slot of the device limit (a GPU) while it builds."""
    holds: tuple[Held, ...] = ()
    """The models in memory at its peak (`trainers.models.memory`; `rlhf check` adds LoRA, beta and the rewards'
    choices)."""
    algorithm: bool = False
    """One of the policy-optimisation choices (`algorithm=<name>`)."""
    online: bool = False
    """Samples rollouts and scores them with `rewards`."""
    pairs: bool = False
    """Reads preference pairs (chosen/rejected); unpaired rows (completion/label) are refused for it. With the `pairs`
    stage on, it reads the made ones (`upstream` lists `pairs`)."""


PREFERENCES = ("preference",)
ONLINE_UPSTREAM = ("data", "sft", "rm")
STAGES: tuple[Stage, ...] = (
    Stage(
        name="data",
        config=DataConfig,
        code=data_stage,
        builds_with="data",
        description="Datasets, checked and frozen by the `data` stage.",
    ),
    Stage(
        name="sft",
        config=SftConfig,
        code=sft,
        builds_with="train",
        description="Supervised fine-tuning (TRL SFTTrainer).",
        reads=("sft",),
        upstream=("data",),
        device=True,
        holds=(POLICY,),
    ),
    Stage(
        name="pairs",
        config=PairsConfig,
        code=pairs_stage,
        builds_with="pairs",
        description=(
            "Preference pairs made from prompts: the starting policy's samples labelled by a verifier, the reward "
            "model, a judge or people (switched off by default)."
        ),
        reads=("prompts",),
        upstream=("data", "sft", "rm"),
        device=True,
        holds=(SAMPLING,),
    ),
    Stage(
        name="rm",
        config=RewardModelConfig,
        code=rm,
        builds_with="train",
        description="Reward model (TRL RewardTrainer).",
        reads=("preference", "preference_eval"),
        upstream=("data", "sft", "pairs"),
        device=True,
        holds=(TRAINED_REWARD_MODEL,),
        pairs=True,
    ),
    Stage(
        name="dpo",
        config=DpoConfig,
        code=dpo,
        builds_with="train",
        description="DPO (TRL DPOTrainer).",
        reads=PREFERENCES,
        upstream=("data", "sft", "pairs"),
        device=True,
        holds=(POLICY, REFERENCE),
        algorithm=True,
        pairs=True,
    ),
    Stage(
        name="kto",
        config=KtoConfig,
        code=kto,
        builds_with="train",
        description="KTO (TRL KTOTrainer): unpaired binary feedback; pairs are unpaired.",
        reads=PREFERENCES,
        upstream=("data", "sft", "pairs"),
        device=True,
        holds=(POLICY, REFERENCE),
        algorithm=True,
    ),
    Stage(
        name="orpo",
        config=OrpoConfig,
        code=orpo,
        builds_with="train",
        description="ORPO (TRL ORPOTrainer): preference pairs, no reference model, the SFT loss folded in.",
        reads=PREFERENCES,
        upstream=("data", "sft", "pairs"),
        device=True,
        holds=(POLICY,),
        algorithm=True,
        pairs=True,
    ),
    Stage(
        name="grpo",
        config=GrpoConfig,
        code=grpo,
        builds_with="train",
        description="GRPO (TRL GRPOTrainer).",
        reads=("prompts",),
        upstream=ONLINE_UPSTREAM,
        device=True,
        holds=(POLICY, REFERENCE, REWARD_MODEL),
        algorithm=True,
        online=True,
    ),
    Stage(
        name="rloo",
        config=RlooConfig,
        code=rloo,
        builds_with="train",
        description="RLOO (TRL RLOOTrainer).",
        reads=("prompts",),
        upstream=ONLINE_UPSTREAM,
        device=True,
        holds=(POLICY, REFERENCE, REWARD_MODEL),
        algorithm=True,
        online=True,
    ),
    Stage(
        name="ppo",
        config=PpoConfig,
        code=ppo,
        builds_with="train",
        description="PPO (ours: trainers/ppo/train.py).",
        reads=("prompts",),
        upstream=ONLINE_UPSTREAM,
        device=True,
        holds=(POLICY, REFERENCE, VALUE_MODEL, REWARD_MODEL),
        algorithm=True,
        online=True,
    ),
    Stage(
        name="eval",
        config=EvalConfig,
        code=evaluation,
        builds_with="eval",
        description="Held-out evaluation of the policy against SFT, the base model and the champion.",
        reads=("prompts_eval", "preference_eval", "sft"),
        upstream=("data", "sft", POLICY_STAGE, "rm"),
        device=True,
        holds=EVALUATED,
    ),
    Stage(
        name="registry",
        config=RegistryConfig,
        code=None,
        builds_with="registry",
        description="MLflow model registry and promotion gate.",
        upstream=(POLICY_STAGE, "eval"),
    ),
)
BY_NAME = {stage.name: stage for stage in STAGES}
ALGORITHMS: tuple[str, ...] = tuple(stage.name for stage in STAGES if stage.algorithm)


def reads(stage: str, config: StageConfig) -> tuple[str, ...]:
    """The datasets `stage` reads with this config: the row's, and the held-out ones it evaluates on while training;
    none when the stage is switched off (`sft.enabled: false`)."""
    if config.switched_off():
        return ()
    return (*BY_NAME[stage].reads, *(name for name in config.held_out() if name not in BY_NAME[stage].reads))


def pair_readers(stages: list[str] | None = None) -> dict[str, tuple[str, ...]]:
    """Dataset -> the stages (of `stages`, default: all) that read it as preference pairs."""
    readers: dict[str, tuple[str, ...]] = {}
    for stage in STAGES:
        if stage.pairs and (stages is None or stage.name in stages):
            for dataset in stage.reads:
                readers[dataset] = (*readers.get(dataset, ()), stage.name)
    return readers
