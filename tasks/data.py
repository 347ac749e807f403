"""`data`: validate every dataset with Great Expectations, then freeze Parquet copies for later stages."""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.stage import RunContext, StageOutcome, prefect_log, run_stage, stage_task
from trainers.data import DataConfig, fingerprint, load_source


@stage_task("data")
def validate_data(config: DataConfig, ctx: RunContext) -> StageOutcome:
    fingerprints = {name: fingerprint(spec) for name, (_, spec) in config.sources().items()}

    def build(out_dir: Path, work_dir: Path, log_metrics) -> dict[str, float]:
        from validators import DataValidationError, validate_dataset

        failures: list[DataValidationError] = []
        metrics: dict[str, float] = {}
        for name, (kind, spec) in config.sources().items():
            dataset = load_source(spec)
            try:
                # Reports go to the work dir first: it survives a failure, so the
                # Data Docs path in the error message stays valid.
                validate_dataset(kind, dataset, source=spec.path, report_dir=work_dir / "report" / name)
            except DataValidationError as exc:
                failures.append(exc)
                continue
            dataset.to_parquet(str(out_dir / "datasets" / f"{name}.parquet"))
            metrics[f"data/{name}/rows"] = float(len(dataset))
        # Report every broken dataset at once, then stop before any training.
        if len(failures) == 1:
            raise failures[0]
        if failures:
            raise ValueError(f"{len(failures)} datasets failed validation:\n" + "\n".join(map(str, failures)))
        shutil.copytree(work_dir / "report", out_dir / "report")
        return metrics

    return run_stage("data", config, {}, ctx, build, fingerprints, log_files=("report",), log=prefect_log)
