"""Reward modelling with TRL's RewardTrainer (Bradley-Terry on preference pairs).

The reward model starts from the SFT model with a scalar head, as in InstructGPT,
so it reads answers the way the policy writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.algorithms.fields import TrainingConfig
from rlhf_pipeline.trainers.config import EvalDuringTraining, LogMetrics


class RewardModelConfig(EvalDuringTraining, TrainingConfig):
    trl_config: ClassVar[str] = "RewardConfig"
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate (TRL RewardConfig default 1e-4).")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="Pull mean reward towards 0 (TRL RewardConfig.center_rewards_coefficient)."
    )
    ensemble_size: int = Field(
        1,
        ge=1,
        le=16,
        description=(
            "Reward models trained (seed + i, each on its own bootstrap resample of the pairs) and kept in one rm "
            "artifact; the online stages aggregate them (rewards.reward_model_aggregate) and eval reports their "
            "disagreement."
        ),
    )
    ensemble_bootstrap: bool = Field(
        True,
        description=(
            "Each member after the first trains on a bootstrap resample of the pairs (else all of them, in its own "
            "order)."
        ),
    )
    weight_average: bool = Field(
        False,
        description=(
            "WARM (Rame et al. 2024): serve the members' weight average as the one reward model (the members share "
            "the score head's initialisation); the members still measure disagreement in eval. "
            "Needs ensemble_size > 1."
        ),
    )

    @model_validator(mode="after")
    def _ensemble(self):
        if self.weight_average and self.ensemble_size < 2:
            raise ValueError("rm.weight_average averages the members of an ensemble: set rm.ensemble_size to 2 or more")
        if self.ensemble_size > 1 and self.lora.enabled and self.lora.keep_adapter:
            raise ValueError(
                "rm.ensemble_size > 1 keeps whole members (their weights are averaged and aggregated): set "
                "rm.lora.keep_adapter=false"
            )
        return self

    def held_out(self) -> tuple[str, ...]:
        return ("preference_eval",) if self.evaluates else ()


def train(
    cfg: RewardModelConfig,
    sft_model: Path,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
) -> dict[str, float]:
    """Train a scalar reward head on `preference` (`ensemble_size` of them); report pairwise accuracy on
    `preference_eval` if present. With the `pairs` stage on, `preference` is the made pairs (`tasks.training`).

    An ensemble's members train one after another, each resuming from its own checkpoints (`work_dir/member-<i>`)."""
    if cfg.ensemble_size == 1:
        return _train_one(cfg, sft_model, data_dir, out_dir, work_dir, log_metrics)
    import json
    import shutil

    from rlhf_pipeline.trainers.rewards.ensemble import ENSEMBLE_FILE, MEMBERS, average_weights, member_dirs

    metrics: dict[str, float] = {}
    for i in range(cfg.ensemble_size):
        member = cfg.model_copy(update={"ensemble_size": 1, "seed": cfg.seed + i})
        log = (
            None
            if log_metrics is None
            else (lambda values, step, i=i: log_metrics((values if i == 0 else {}) | _member_metrics(values, i), step))
        )
        result = _train_one(
            member,
            sft_model,
            data_dir,
            out_dir / MEMBERS / str(i),
            work_dir / f"member-{i}",
            log,
            resample=i if cfg.ensemble_bootstrap else None,
            head_seed=cfg.seed if cfg.weight_average else cfg.seed + i,
        )
        metrics |= result if i == 0 else {}
        metrics |= _member_metrics(result, i)
    (out_dir / ENSEMBLE_FILE).write_text(
        json.dumps({"members": cfg.ensemble_size, "served": "average" if cfg.weight_average else "ensemble"})
    )
    dirs = member_dirs(out_dir / "model")
    if cfg.weight_average:
        average_weights(dirs, out_dir / "model")
    else:  # the served folder (and PPO's value model's start) is member 0
        shutil.copytree(dirs[0], out_dir / "model")
    shutil.copyfile(out_dir / MEMBERS / "0" / "training.json", out_dir / "training.json")
    return metrics


def _member_metrics(values: dict[str, float], i: int) -> dict[str, float]:
    """rm/<split>/<name> -> rm/member_<i>/<split>_<name>: every member's curves, beside the first's as the stage's
    own."""
    return {f"rm/member_{i}/{name.removeprefix('rm/').replace('/', '_')}": v for name, v in values.items()}


def _train_one(
    cfg: RewardModelConfig,
    sft_model: Path,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
    resample: int | None = None,
    head_seed: int | None = None,
) -> dict[str, float]:
    """One reward model into `out_dir/model`; `resample` > 0: on a bootstrap resample of the pairs (seeded by it);
    `head_seed`: torch seeded with it before the score head is made."""
    import torch
    import trl

    from rlhf_pipeline.trainers.algorithms.loop import (
        final_train_metrics,
        fit,
        save_on_main,
        stage_callbacks,
    )
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.load import has_adapter, load_sequence_classifier, load_tokenizer

    # The TRL config first: a combination TRL refuses fails before any weights load.
    args = trl.RewardConfig(
        **cfg.trl_arguments(work_dir),
        max_length=cfg.max_length,
        center_rewards_coefficient=cfg.center_rewards_coefficient,
        **cfg.eval_arguments(),
    )
    tokenizer = load_tokenizer(sft_model)
    if has_adapter(sft_model) and cfg.lora.handoff != "merge":
        raise ValueError(
            f"{sft_model} holds sft's LoRA adapter: the reward model starts from it merged (rm.lora.handoff=merge; a "
            "score head is added)"
        )
    if head_seed is not None:  # an ensemble member's fresh score head: its own initialisation, or WARM's shared one
        torch.manual_seed(head_seed)
    model = load_sequence_classifier(sft_model, attn_implementation=cfg.attn_implementation)
    model.config.pad_token_id = tokenizer.pad_token_id
    eval_path = data_dir / "datasets" / "preference_eval.parquet"
    eval_dataset = load_split(data_dir, "preference_eval") if eval_path.is_file() else None
    if cfg.evaluates and eval_dataset is None:
        raise ValueError(
            f"rm.eval_strategy={cfg.eval_strategy!r} evaluates on preference_eval, which the data stage did not write "
            f"({eval_path})"
        )
    trainer = trl.RewardTrainer(
        model=model,
        args=args,
        train_dataset=_resampled(load_split(data_dir, "preference"), resample),
        eval_dataset=eval_dataset,
        compute_metrics=cfg.metrics_function(),
        processing_class=tokenizer,
        peft_config=cfg.lora.peft_config("SEQ_CLS"),
        callbacks=stage_callbacks("rm", log_metrics, cfg),
    )
    fit(trainer, cfg, work_dir, out_dir)
    metrics = final_train_metrics("rm", trainer)
    if eval_dataset is not None:
        trainer.evaluate()  # logs rm/eval/accuracy through the callback and into log_history
        metrics = final_train_metrics("rm", trainer)
    # GRPO/RLOO load a reward model by path together with its tokenizer
    # (docs/LIBRARY-FACTS.md, TRL and transformers).
    save_on_main(trainer, tokenizer, out_dir / "model", keep_adapter=cfg.lora.keep_adapter)
    return metrics


def _resampled(dataset, seed: int | None):
    """A bootstrap resample (as many rows, drawn with replacement) for an ensemble member; member 0 and None: the pairs
    as they are."""
    if not seed:
        return dataset
    import numpy as np

    return dataset.select(np.random.default_rng(seed).integers(0, len(dataset), len(dataset)).tolist())
