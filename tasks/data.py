"""`data`: check every dataset (raw file, Great Expectations rules, token lengths, train/eval leakage), then freeze Parquet copies for later stages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_pipeline.tasks.orchestration import prefect_log, stage_task
from rlhf_pipeline.tasks.stage import RunContext, StageOutcome, run_stage
from rlhf_pipeline.trainers.common import ModelConfig, load_tokenizer
from rlhf_pipeline.trainers.data import DataConfig, fingerprint, load_source, local_files

if TYPE_CHECKING:
    from rlhf_pipeline.validators import ValidationReport

# Held-out dataset -> the datasets trained on that must not share a prompt with it.
HELD_OUT = {
    "preference_eval": ("preference",),  # reward-model accuracy is measured on it
    # Exact match of the final policy: SFT, DPO and the online trainers all saw their prompts.
    "prompts_eval": ("sft", "preference", "prompts"),
}


@stage_task("data")
def validate_data(
    config: DataConfig,
    ctx: RunContext,
    model: ModelConfig | None = None,
    max_tokens: dict[str, int] | None = None,
) -> StageOutcome:
    """Validate every dataset of `config`; publish nothing unless all pass.

    `max_tokens` maps a dataset name ("sft", "preference", ...) to the most
    tokens one of its rows may take (rule `fits_max_length`), counted with the
    tokenizer of `model`; both enter the stage key.
    """
    limits = _token_limits(config, model, max_tokens)
    sources = config.sources()
    fingerprints = {name: fingerprint(spec) for name, (_, spec) in sources.items()}
    keyed = config.model_dump(mode="json")
    if limits:
        # Without limits the key stays the DataConfig's alone; with them, the tokenizer counts too.
        tokenizer_id = model.model_dump(mode="json", include={"name_or_path", "revision", "trust_remote_code"})
        keyed = {**keyed, "max_tokens": limits, "tokenizer": tokenizer_id}

    def build(out_dir: Path, work_dir: Path, log_metrics) -> dict[str, float]:
        from rlhf_pipeline.validators import DataValidationError, check_files, validate_dataset
        from rlhf_pipeline.validators.leakage import Split, check_leakage
        from rlhf_pipeline.validators.validate import REPORT_FILE

        # Reports go to the work dir first: it survives a failure, so the
        # Data Docs path in the error message stays valid.
        report_dir = work_dir / "report"
        tokenizer = load_tokenizer(model.name_or_path, model) if limits else None
        failures: list[ValueError] = []
        passed: dict[str, tuple[Split, ValidationReport]] = {}
        for name, (kind, spec) in sources.items():
            # Raw bytes first: `datasets` names neither file nor line for a cut-off
            # JSON line, a non-UTF-8 byte or an empty file.
            files = check_files(kind, local_files(spec) or [])
            _write_file_reports(files, report_dir / name)
            broken = [report for report in files if not report.success]
            if broken:
                failures += [DataValidationError(report) for report in broken]
                continue
            try:
                dataset = load_source(spec)
                report = validate_dataset(
                    kind,
                    dataset,
                    source=spec.path,
                    report_dir=report_dir / name,
                    max_tokens=limits.get(name),
                    tokenizer=tokenizer,
                )
            except ValueError as exc:  # a broken rule, or a file `datasets` cannot read
                failures.append(exc)
                continue
            passed[name] = (Split(name, kind, spec.path, dataset), report)

        for held_out, trained in HELD_OUT.items():
            training = [passed[name][0] for name in trained if name in passed]
            if held_out not in passed or not training:
                continue  # a dataset that failed its own rules is already reported
            split, report = passed[held_out]
            report.rules.append(check_leakage(split, training))
            report.write_json(report_dir / held_out / REPORT_FILE)
            if not report.success:
                failures.append(DataValidationError(report))

        # Report every broken dataset at once, then stop before any training.
        if len(failures) == 1:
            raise failures[0]
        if failures:
            raise ValueError(f"{len(failures)} data checks failed:\n" + "\n".join(map(str, failures)))
        metrics: dict[str, float] = {}
        for name, (split, _) in passed.items():
            split.dataset.to_parquet(str(out_dir / "datasets" / f"{name}.parquet"))
            metrics[f"data/{name}/rows"] = float(len(split.dataset))
        shutil.copytree(report_dir, out_dir / "report")
        return metrics

    # Dependents key on the frozen datasets alone: a stricter rule or a new report re-trains nothing.
    return run_stage("data", keyed, {}, ctx, build, fingerprints, log_files=("report",), log=prefect_log, digest_of=("datasets",))


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


def _write_file_reports(reports: list[ValidationReport], directory: Path) -> None:
    if reports:
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps([report.to_dict() for report in reports], indent=2, ensure_ascii=False)
        (directory / "files.json").write_text(text + "\n")
