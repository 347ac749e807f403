"""`data`: check every dataset (raw file, Great Expectations rules, token lengths, train/eval leakage), then freeze
Parquet copies for later stages."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_pipeline.tasks.orchestration.stage_task import device_hold, lock_holder, prefect_log, stage_task
from rlhf_pipeline.tasks.stages import BY_NAME, pair_readers
from rlhf_pipeline.tasks.store.artifacts import RunContext, StageOutcome
from rlhf_pipeline.tasks.store.stage import run_stage
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking.recorder import MLFLOW
from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.data import DataConfig, dataset_fingerprint
from rlhf_pipeline.trainers.models.checkpoints import content_id


@stage_task("data")
def validate_data(
    config: DataConfig,
    ctx: RunContext,
    model: ModelConfig | None = None,
    max_tokens: dict[str, int] | None = None,
    pairs_for: dict[str, tuple[str, ...]] | None = None,
    assistant_only_loss: bool = False,
    required_columns: dict[str, tuple[str, ...]] | None = None,
    benchmarks: tuple[str, ...] = (),
) -> StageOutcome:
    """Validate every dataset of `config`; publish nothing unless all pass (`validators.stage.train`).

    `max_tokens` maps a dataset name ("sft", "preference", ...) to the most
    tokens one of its rows may take (rule `fits_max_length`), counted with the
    tokenizer of `model`; both enter the stage key. `pairs_for` maps a dataset to
    the stages that need it as pairs (default: every stage of the table that reads
    pairs), which then refuse unpaired rows (rule `paired_for_readers`).
    """
    pairs_for = pair_readers() if pairs_for is None else pairs_for
    _check_readable(config)
    limits = _token_limits(config, model, max_tokens)
    sources = config.sources()
    fingerprints = {name: dataset_fingerprint(spec) for name, (_, spec) in sources.items()}
    keyed = _keyed(config, model, limits, pairs_for, assistant_only_loss, benchmarks, required_columns)

    def build(out_dir: Path, work_dir: Path, log_metrics) -> dict[str, float]:
        from rlhf_pipeline.validators import stage as data

        try:
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
                benchmarks=benchmarks,
                gx_project=tracking.state_dir(),  # GX's file context, its validation history: <state>/gx/
            )
        except Exception:
            publish_failed_rules(work_dir / "report")  # before the error ends the task: the run explains itself
            raise
        _log_duplicates(sources, metrics, out_dir)
        return metrics

    row = BY_NAME["data"]
    # Dependents key on the frozen datasets alone (a stricter rule or a new report re-trains nothing, nor do the
    # report's Data Docs with their run times), and each on the datasets it reads (`parts`): a new preference file
    # does not re-run sft.
    outcome = run_stage(
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
        code=row.code,
        hold=device_hold(row.name, row.device, prefect_log, ctx.wait_seconds),
        record=MLFLOW,
        holder=lock_holder(),
    )
    link_data_docs(outcome, list(sources))
    return outcome


def _keyed(
    config: DataConfig, model, limits, pairs_for, assistant_only_loss: bool, benchmarks, required_columns
) -> dict:
    """What the data stage keys on: the data block, and what the rules depend on (the tokenizer and its template, the
    token limits, which stages read pairs, the benchmarks kept out of training, the columns the gate needs)."""
    keyed = config.model_dump(mode="json")
    if model is not None:
        # The tokenizer (and its chat template) decides the template and length rules.
        tokenizer_id = {
            **model.model_dump(mode="json", include={"name_or_path", "revision", "trust_remote_code", "chat_template"}),
            "content": content_id(model.name_or_path, model.revision),
        }
        keyed = {**keyed, "max_tokens": limits, "tokenizer": tokenizer_id, "assistant_only_loss": assistant_only_loss}
    keyed = {**keyed, "pairs_for": {name: list(stages) for name, stages in sorted(pairs_for.items())}}
    if benchmarks:  # the benchmarks whose test prompts no training prompt may be (validators.stage)
        keyed = {**keyed, "benchmarks": list(benchmarks)}
    if required_columns:
        keyed = {
            **keyed,
            "required_columns": {name: list(columns) for name, columns in sorted(required_columns.items())},
        }
    return keyed


def _log_duplicates(sources: dict, metrics: dict[str, float], out_dir: Path) -> None:
    """One line per dataset with rows that repeat an earlier row exactly: kept, and reported."""
    from rlhf_pipeline.validators import stage as data

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


REPORT_ARTIFACT = "rlhf-data-report"
DOCS_ARTIFACT = "rlhf-data-docs"


def failed_rules(report_dir: Path) -> list[dict[str, object]]:
    """One row per failed rule of the reports in `report_dir/<dataset>/` (raw file checks, then the dataset's
    rules): dataset, file, rule, rows failed, example rows."""
    rows: list[dict[str, object]] = []
    for folder in sorted(path for path in report_dir.glob("*") if path.is_dir()):
        reports = []
        if (folder / "files.json").is_file():
            reports += json.loads((folder / "files.json").read_text())
        if (folder / "validation.json").is_file():
            reports.append(json.loads((folder / "validation.json").read_text()))
        for report in reports:
            unit = report.get("unit", "row")
            for rule in report["rules"]:
                if rule["success"]:
                    continue
                examples = "; ".join(f"{unit} {e[unit]}: {e['value']}" for e in rule["examples"][:MAX_EXAMPLE_ROWS])
                rows.append(
                    {
                        "dataset": folder.name,
                        "file": report["source"],
                        "rule": rule["rule"],
                        f"{unit}s failed": rule["failed_count"],
                        "example rows": examples or rule["description"],
                    }
                )
    return rows


MAX_EXAMPLE_ROWS = 3


def publish_failed_rules(report_dir: Path) -> None:
    """The failed rules and rows as a Prefect table artifact of the task run (`rlhf-data-report`), when the data
    checks ran inside one."""
    rows = failed_rules(report_dir)
    if not rows or not _in_prefect_run():
        return
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        key=REPORT_ARTIFACT,
        table=rows,
        description=f"Data checks failed: {len(rows)} rules broken; the reports and Data Docs are in {report_dir}",
    )


def link_data_docs(outcome: StageOutcome, names: list[str]) -> None:
    """Each dataset's Data Docs, linked from the stage's MLflow run (tags `rlhf.data_docs.<dataset>`) and from the
    Prefect run (a markdown artifact, `rlhf-data-docs`, and a log line): the report's copy among the MLflow run's
    artifacts over http where an MLflow server serves them (a browser opens no file:// link from an http page), else
    the page in the state folder's GX site, whose index lists every validation."""
    pages: dict[str, tuple[dict, str | None]] = {}
    for name in names:
        path = outcome.ref.path / "report" / name / "validation.json"
        if path.is_file():
            report = json.loads(path.read_text())
            found = docs_artifact(outcome, name, report)
            pages[name] = report, (found and tracking.artifact_page(*found)) or report.get("history")
    links = {f"rlhf.data_docs.{name}": link for name, (_, link) in pages.items() if link}
    if links and outcome.mlflow_run_id:
        tracking.set_tags(outcome.mlflow_run_id, links)
    for name, (_, link) in pages.items():
        if link and link.startswith("http"):
            prefect_log(f"data: {name}: Data Docs {link}")
    if not pages or not _in_prefect_run():
        return
    from prefect.artifacts import create_markdown_artifact

    lines = ["| dataset | file | rows | rules | Data Docs |", "|---|---|---:|---|---|"]
    for name, (report, link) in pages.items():
        passed = sum(rule["success"] for rule in report["rules"])
        if link and link.startswith("http"):
            docs = f"[this run]({link})"
        else:
            docs = f"[history]({link})" if link else "-"
            copy = report.get("data_docs")
            docs += f" (this run: `{copy}`)" if copy else ""
        rules = f"{passed} of {len(report['rules'])} passed"
        lines.append(f"| {name} | `{report['source']}` | {report['num_rows']} | {rules} | {docs} |")
    create_markdown_artifact(
        key=DOCS_ARTIFACT,
        markdown="# Data checks\n\n" + "\n".join(lines) + "\n",
        description="Great Expectations Data Docs of every dataset the data stage checked",
    )


def docs_artifact(outcome: StageOutcome, name: str, report: dict) -> tuple[str, str] | None:
    """Dataset `name`'s Data Docs page among the artifacts of the MLflow run that logged the report (this run, or for a
    cached one the run that built it, when this tracking store has it): (run id, artifact path), or None. Its page in
    the MLflow UI (`tracking.artifact_page`) is the link people follow; the server's URL of the file
    (`tracking.artifact_url`) keeps the site's relative links, but a browser saves it."""
    from rlhf_pipeline.validators.validate import DATA_DOCS_DIR

    copy = report.get("data_docs")
    run_id = outcome.mlflow_run_id
    if outcome.cached:
        run_id = outcome.ref.manifest().get("mlflow_run_id", "")
    if not copy or not run_id or DATA_DOCS_DIR not in Path(copy).parts or not tracking.run_exists(run_id):
        return None
    parts = Path(copy).parts
    page = parts[len(parts) - 1 - parts[::-1].index(DATA_DOCS_DIR) :]  # the page inside the report's Data Docs
    return run_id, "/".join(("report", name, *page))


def _in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


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


def _check_readable(config: DataConfig) -> None:
    """Every local file a dataset names, checked again as the stage reads it against the folders the worker lets runs
    read: the parameters' check (flows/ownership.py) saw only the files that existed then."""
    from rlhf_pipeline.trainers.data import check_readable

    for name, (_, spec) in config.sources().items():
        check_readable(spec, f"data.{name}.path", tracking.always_readable())
