"""The training stages (every row of the table built with `train`): one task, and the trainer contract,
described here once (docs/ARCHITECTURE.md, "The trainer contract").

A stage's trainer is `train(cfg, ...)` in the module the table names; the task fills its parameters by name, so a new
stage needs a trainer and a row, not new plumbing:

    cfg           the stage's config block (a `StageConfig`)
    data_dir      the data artifact (it keys on the datasets the row `reads`, not on all of them)
    sft_model     the `sft` artifact's model folder      reward_model  the `rm` artifact's (or None)
    model         the run's base model block              rewards       the run's rewards block
    out_dir, work_dir, log_metrics                        as in `tasks.store.stage.run_stage`

With the `pairs` stage on, `data_dir/datasets/preference.parquet` is the made pairs (`with_made_pairs`).

The blocks a trainer takes besides its own (`model`, `rewards`) are keyed with its config: changing the
rewards re-runs the online stages only. A trainer writes `out_dir/model`, checkpoints into `work_dir`, returns its
final metrics and emits progress records (`trainers.runtime.progress`); it imports no Prefect.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

from rlhf_pipeline.tasks.orchestration.launcher import run_launched
from rlhf_pipeline.tasks.orchestration.stage_task import device_hold, lock_holder, prefect_log, stage_task
from rlhf_pipeline.tasks.stages import BY_NAME, STAGES, Stage, reads
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, RunContext, StageOutcome
from rlhf_pipeline.tasks.store.stage import run_stage
from rlhf_pipeline.tasks.tracking.recorder import MLFLOW
from rlhf_pipeline.trainers.config import Block, ModelConfig, StageConfig
from rlhf_pipeline.trainers.models.checkpoints import keyed_model

MODEL_INPUTS = {"sft_model": "sft", "reward_model": "rm"}
"""Trainer parameter -> the upstream stage whose `model/` folder it receives (a feedback round's policy starts from
the last round's: it arrives as `sft`)."""
SETTINGS = ("model", "rewards", "gold")
"""Run-level blocks a trainer may take besides its own config (`gold`: the held-out gold metric its probes score)."""
LOGGED = ("samples.jsonl", "heldout.jsonl")
"""Files a trainer may write beside its model that are also logged to its MLflow run (ppo's sample tables, the
held-out probes)."""
PROVIDED = {"cfg", "data_dir", "out_dir", "work_dir", "log_metrics", *MODEL_INPUTS, *SETTINGS}


def trainer_parameters(stage: Stage) -> tuple[str, ...]:
    """The parameters of the stage's `train`, checked against what the task can fill."""
    parameters = inspect.signature(stage.code.train).parameters
    unknown = [name for name, p in parameters.items() if name not in PROVIDED and p.default is inspect.Parameter.empty]
    if unknown:
        raise TypeError(
            f"{stage.code.__name__}.train takes {unknown}, which no stage provides; it may take {sorted(PROVIDED)}"
        )
    return tuple(parameters)


def settings_of(stage: Stage) -> tuple[str, ...]:
    """The run-level blocks (`model`, `rewards`, `gold`) the stage's trainer takes: they key the stage."""
    return tuple(name for name in trainer_parameters(stage) if name in SETTINGS)


def code_fingerprints(config: StageConfig, settings: dict[str, Block]) -> dict[str, str]:
    """The source digest of every import path the stage runs (its optimizer factory, callbacks, compute_metrics; the
    reward functions of `rewards`): editing one re-runs the stages that use it and nothing else."""
    from rlhf_pipeline.trainers.runtime.custom import source_digests

    paths = [*config.code_paths(), *(path for block in settings.values() for path in block.code_paths())]
    return source_digests(paths)


def train_stage(
    stage: str,
    config: StageConfig,
    settings: dict[str, Block],
    upstream: dict[str, ArtifactRef],
    ctx: RunContext,
    round_: int = 0,
) -> StageOutcome:
    """Build (or reuse) one training stage of the table from its config, the blocks it takes and its upstream artifacts;
    `round_` > 0: a feedback round's (tagged with it; its `pairs` upstream is the round's)."""
    row = BY_NAME[stage]
    wanted = trainer_parameters(row)
    data = upstream["data"]
    fingerprints = code_fingerprints(config, settings)

    def build(out_dir, work_dir, log_metrics) -> dict[str, float]:
        from rlhf_pipeline.trainers.algorithms.loop import match_cpu_threads

        match_cpu_threads()
        given: dict[str, Any] = {
            "cfg": config,
            "data_dir": with_made_pairs(data.path, upstream["pairs"].path, work_dir)
            if "pairs" in upstream
            else data.path,
            "out_dir": out_dir,
            "work_dir": work_dir,
            **settings,
        }
        given |= {
            param: upstream[source].path / "model" if source in upstream else None
            for param, source in MODEL_INPUTS.items()
        }
        arguments = {name: value for name, value in given.items() if name in wanted}
        if ctx.launch.launcher_of(stage) != "inprocess":  # processes of its own; rank 0 writes into out_dir
            return run_launched(stage, row.code.__name__, arguments, work_dir, log_metrics, prefect_log, ctx.launch)
        return row.code.train(**arguments, log_metrics=log_metrics)

    switched_off = config.switched_off()
    keyed = {
        # Switched off, the stage's training settings change nothing it writes.
        stage: {"enabled": False} if switched_off else config.model_dump(mode="json"),
        # The base model counts with its content: other weights under the same name are another model.
        **{
            name: keyed_model(block) if isinstance(block, ModelConfig) else block.model_dump(mode="json")
            for name, block in settings.items()
        },
    }
    datasets = reads(stage, config)
    if "pairs" in upstream:  # the `pairs` stage's artifact holds the preference pairs it trains on
        datasets = tuple(name for name in datasets if name != "preference")
    inputs = {**{name: ref for name, ref in upstream.items() if name != "data"}, "data": data.select(datasets)}
    outcome = run_stage(
        stage,
        keyed,
        inputs,
        ctx,
        build,
        fingerprints=fingerprints,
        log_files=LOGGED,
        log=prefect_log,
        code=row.code,
        hold=device_hold(stage, row.device, prefect_log, ctx.wait_seconds),
        extra_tags={"rlhf.round": str(round_)} if round_ else None,
        system_metrics=row.device,
        record=MLFLOW,
        holder=lock_holder(),
    )
    return dataclasses.replace(outcome, state="skipped") if switched_off else outcome


def with_made_pairs(data_dir: Path, pairs_dir: Path, work_dir: Path) -> Path:
    """The data artifact as the stage sees it when it trains on made pairs: every dataset linked from `data_dir`, the
    preference pairs from the `pairs` artifact (`work_dir/data`, remade each build; the artifacts stay untouched)."""
    import shutil

    seen = work_dir / "data"
    shutil.rmtree(seen, ignore_errors=True)
    (seen / "datasets").mkdir(parents=True)
    for dataset in (data_dir / "datasets").glob("*.parquet"):
        (seen / "datasets" / dataset.name).symlink_to(dataset)
    made = seen / "datasets" / "preference.parquet"
    made.unlink(missing_ok=True)
    made.symlink_to(pairs_dir / "datasets" / "preference.parquet")
    return seen


TASKS = {row.name: stage_task(row.name)(train_stage) for row in STAGES if row.builds_with == "train"}
"""The Prefect task of every training stage, named after it."""
