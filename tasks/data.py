"""`data`: check every dataset (raw file, Great Expectations rules, token lengths, train/eval leakage), then freeze
Parquet copies for later stages."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_pipeline.tasks.artifacts import RunContext, StageOutcome
from rlhf_pipeline.tasks.orchestration import device_hold, prefect_log, stage_task
from rlhf_pipeline.tasks.stages import BY_NAME, pair_readers
from rlhf_pipeline.tasks.store import run_stage
from rlhf_pipeline.trainers.checkpoints import content_id
from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.data import DataConfig, dataset_fingerprint


@stage_task("data")
def validate_data(
    config: DataConfig,
    ctx: RunContext,
    model: ModelConfig | None = None,
    max_tokens: dict[str, int] | None = None,
    pairs_for: dict[str, tuple[str, ...]] | None = None,
    assistant_only_loss: bool = False,
    required_columns: dict[str, tuple[str, ...]] | None = None,
) -> StageOutcome:
    """Validate every dataset of `config`; publish nothing unless all pass (`validators.stage.train`).

    `max_tokens` maps a dataset name ("sft", "preference", ...) to the most
    tokens one of its rows may take (rule `fits_max_length`), counted with the
    tokenizer of `model`; both enter the stage key. `pairs_for` maps a dataset to
    the stages that need it as pairs (default: every stage of the table that reads
    pairs), which then refuse unpaired rows (rule `paired_for_readers`).
    """
    pairs_for = pair_readers() if pairs_for is None else pairs_for
    limits = _token_limits(config, model, max_tokens)
    sources = config.sources()
    fingerprints = {name: dataset_fingerprint(spec) for name, (_, spec) in sources.items()}
    keyed = config.model_dump(mode="json")
    if model is not None:
        # The tokenizer (and its chat template) decides the template and length rules.
        tokenizer_id = {
            **model.model_dump(mode="json", include={"name_or_path", "revision", "trust_remote_code", "chat_template"}),
            "content": content_id(model.name_or_path, model.revision),
        }
        keyed = {**keyed, "max_tokens": limits, "tokenizer": tokenizer_id, "assistant_only_loss": assistant_only_loss}
    keyed = {**keyed, "pairs_for": {name: list(stages) for name, stages in sorted(pairs_for.items())}}
    if required_columns:
        keyed = {
            **keyed,
            "required_columns": {name: list(columns) for name, columns in sorted(required_columns.items())},
        }

    def build(out_dir: Path, work_dir: Path, log_metrics) -> dict[str, float]:
        from rlhf_pipeline.validators import stage as data

        metrics = data.train(
            config,
            model,
            limits,
            out_dir,
            work_dir,
            log_metrics,
            pairs_for=pairs_for,
            assistant_only_loss=assistant_only_loss,
            required_columns=required_columns,
            fingerprints=fingerprints,
        )
        for name, (_, spec) in sources.items():
            if count := metrics.get(f"data/{name}/duplicate_rows"):
                report = json.loads((out_dir / "report" / name / "validation.json").read_text())
                [rule] = [rule for rule in report["rules"] if rule["rule"] == data.DUPLICATES]
                first = rule["examples"][0]
                prefect_log(
                    f"data: {spec.path}: {count:.0f} of {metrics[f'data/{name}/rows']:.0f} rows repeat an earlier "
                    f"row exactly (e.g. row {first['row']}: {first['value']}); kept, and reported as rule "
                    f"{data.DUPLICATES}"
                )
        return metrics

    row = BY_NAME["data"]
    # Dependents key on the frozen datasets alone (a stricter rule or a new report re-trains nothing),
    # and each on the datasets it reads (`parts`): a new preference file does not re-run sft.
    return run_stage(
        "data",
        keyed,
        {},
        ctx,
        build,
        fingerprints,
        log_files=("report",),
        log=prefect_log,
        digest_of=("datasets",),
        parts={name: f"datasets/{name}.parquet" for name in sources},
        trainer=row.trainer,
        hold=device_hold(row.name, row.device, prefect_log, ctx.wait_seconds),
    )


def _token_limits(config: DataConfig, model: ModelConfig | None, max_tokens: dict[str, int] | None) -> dict[str, int]:
    """max_tokens checked before anything is read: known dataset names, positive limits, a model to count with."""
    limits = dict(sorted((max_tokens or {}).items()))
    names = list(DataConfig.model_fields)
    unknown = sorted(set(limits) - set(names))
    if unknown:
        raise ValueError(f"max_tokens names unknown datasets {unknown}; expected some of {names}")
    bad = {name: limit for name, limit in limits.items() if not isinstance(limit, int) or limit < 1}
    if bad:
        raise ValueError(f"max_tokens must be positive token counts, got {bad}")
    if limits and model is None:
        raise ValueError(f"max_tokens={limits} needs the model whose tokenizer counts the tokens")
    # A limit on a dataset the config leaves out (preference_eval=None) checks nothing.
    return {name: limit for name, limit in limits.items() if name in config.sources()}
