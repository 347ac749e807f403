"""The `data` stage's build: check every dataset (raw bytes, Great Expectations rules, chat template, token lengths,
train/eval leakage), then freeze Parquet copies that later stages read. It sits beside the validators it runs: the
trainers only read what it wrote (`trainers.data.load_split`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.data import DataConfig, load_source, local_files

# Held-out dataset -> the datasets trained on that must not share a prompt with it.
HELD_OUT = {
    "sft_eval": ("sft",),  # sft's evaluation during training
    "preference_eval": ("preference",),  # reward-model accuracy is measured on it
    # Exact match of the final policy: SFT, DPO and the online trainers all saw their prompts.
    "prompts_eval": ("sft", "preference", "prompts"),
}


def train(
    cfg: DataConfig,
    model: ModelConfig,
    max_tokens: dict[str, int],
    out_dir: Path,
    work_dir: Path,
    log_metrics=None,
    pairs_for: dict[str, tuple[str, ...]] | None = None,
    assistant_only_loss: bool = False,
    required_columns: dict[str, tuple[str, ...]] | None = None,
    fingerprints: dict[str, str] | None = None,
    gx_project: Path | None = None,
    benchmarks: tuple[str, ...] = (),
) -> dict[str, float]:
    """The `data` stage: check every dataset (`check_datasets`), then freeze Parquet copies into
    `out_dir/datasets/<name>.parquet` for later stages. Every broken dataset is reported at once and nothing
    is written to `out_dir`; the reports stay in `work_dir/report` (named in the error). With `gx_project`, GX's
    file context under `gx_project/gx/` keeps every validation in its history (validators.suite)."""
    import shutil

    passed, failures = check_datasets(
        cfg,
        model,
        max_tokens,
        work_dir / "report",
        pairs_for,
        assistant_only_loss,
        required_columns=required_columns,
        fingerprints=fingerprints,
        gx_project=gx_project,
        benchmarks=benchmarks,
    )
    # Report every broken dataset at once, then stop before any training.
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise ValueError(f"{len(failures)} data checks failed:\n" + "\n".join(map(str, failures)))
    metrics: dict[str, float] = {}
    for name, (split, report) in passed.items():
        split.dataset.to_parquet(str(out_dir / "datasets" / f"{name}.parquet"))
        metrics[f"data/{name}/rows"] = float(len(split.dataset))
        for rule in report.rules:
            if rule.rule == DUPLICATES:  # the data task logs them, from the report
                metrics[f"data/{name}/duplicate_rows"] = float(rule.failed_count)
    shutil.copytree(work_dir / "report", out_dir / "report")
    return metrics


def check_datasets(
    cfg: DataConfig,
    model: ModelConfig | None,
    max_tokens: dict[str, int],
    report_dir: Path,
    pairs_for: dict[str, tuple[str, ...]] | None = None,
    assistant_only_loss: bool = False,
    tokenizer=None,
    required_columns: dict[str, tuple[str, ...]] | None = None,
    fingerprints: dict[str, str] | None = None,
    gx_project: Path | None = None,
    benchmarks: tuple[str, ...] = (),
) -> tuple[dict[str, tuple], list[ValueError]]:
    """Check every dataset: raw file, Great Expectations rules, chat template and token lengths (counted
    with `model`'s tokenizer, or `tokenizer`), train/eval leakage. Returns the datasets that passed
    (name -> (Split, ValidationReport)) and one error per failure; writes the reports into `report_dir`.

    `max_tokens` maps a dataset name to the most tokens one of its rows may take in the stages that read
    it (rule `fits_max_length`). `pairs_for` names, per dataset, the stages that need preference pairs:
    unpaired rows fail for them. `assistant_only_loss` (sft's): the sft rows' end-of-turn tokens must be
    inside the template's {% generation %} marks. `required_columns` names columns a dataset must have for
    this run (the reference answers a gate on exact match needs, when the parameters could not look: a hub id).
    `fingerprints` (the stage key's): the bytes each local dataset is read from must be these.
    `gx_project`: the folder whose `gx/` holds GX's file context (the data stage's state folder), where each
    dataset's suite is named after it and its validations kept; None (`rlhf check`): an ephemeral context.
    """
    import contextlib

    from rlhf_pipeline.validators.suite import History

    sources = cfg.sources()
    if tokenizer is None and model is not None:
        from rlhf_pipeline.trainers.models.base_model import load_base_tokenizer

        tokenizer = load_base_tokenizer(model)
    checks = _Checks(
        report_dir=report_dir,
        limits={name: limit for name, limit in max_tokens.items() if name in sources},
        tokenizer=tokenizer,
        model_name=repr(model.name_or_path) if model is not None else "the model",
        assistant_only_loss=assistant_only_loss,
        required_columns=required_columns or {},
        pairs_for=pairs_for or {},
        fingerprints=fingerprints or {},
    )
    failures: list[ValueError] = []
    passed: dict[str, tuple] = {}
    # One GX file context for every dataset of the run, opened once (validators.suite.History); None: ephemeral ones.
    history = None if gx_project is None else History(gx_project)
    with history if history is not None else contextlib.nullcontext():
        for name, (kind, spec) in sources.items():
            checked, failed = _check_one(name, kind, spec, checks, history)
            failures += failed
            if checked is not None:
                passed[name] = checked
    failures += _held_out_leaks(passed, report_dir)
    failures += _benchmark_leaks(passed, benchmarks, report_dir)
    return passed, failures


@dataclass(frozen=True)
class _Checks:
    """What every dataset of a run is checked with (`check_datasets`' settings)."""

    report_dir: Path
    limits: dict[str, int]
    tokenizer: object
    model_name: str
    assistant_only_loss: bool
    required_columns: dict[str, tuple[str, ...]]
    pairs_for: dict[str, tuple[str, ...]]
    fingerprints: dict[str, str]


def _check_one(name: str, kind: str, spec, checks: _Checks, history) -> tuple[tuple | None, list[ValueError]]:
    """One dataset: its raw bytes, its rules, finite numbers, the columns this run needs, repeated rows, pairs for the
    stages that need them. Returns ((Split, report) or None, its failures)."""
    import json

    from rlhf_pipeline.validators.files import check_files
    from rlhf_pipeline.validators.leakage import Split
    from rlhf_pipeline.validators.report import DataValidationError
    from rlhf_pipeline.validators.validate import REPORT_FILE, validate_dataset

    report_dir = checks.report_dir / name
    # Raw bytes first: `datasets` names neither file nor line for a cut-off JSON line, a non-UTF-8 byte or an empty
    # file.
    files = check_files(kind, local_files(spec) or [])
    if files:
        report_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps([report.to_dict() for report in files], indent=2, ensure_ascii=False)
        (report_dir / "files.json").write_text(text + "\n")
    broken = [report for report in files if not report.success]
    if broken:
        return None, [DataValidationError(report) for report in broken]
    try:
        dataset = load_source(spec, checks.fingerprints.get(name))
        report = validate_dataset(
            kind,
            dataset,
            source=spec.path,
            report_dir=report_dir,
            max_tokens=checks.limits.get(name),
            tokenizer=checks.tokenizer,
            model_name=checks.model_name,
            assistant_only=checks.assistant_only_loss and name == "sft",
            name=name,
            gx_project=history,
        )
    # A broken rule, or a file `datasets` cannot read
    except ValueError as exc:
        return None, [exc]
    missing = [column for column in checks.required_columns.get(name, ()) if column not in dataset.column_names]
    readers = checks.pairs_for.get(name, ())
    refusals = [
        _finite_numbers(dataset),
        _required_columns(name, missing, dataset.column_names, len(dataset)) if missing else None,
    ]
    if (refused := next((rule for rule in refusals if rule is not None), None)) is not None:
        report.rules.append(refused)
        report.write_json(report_dir / REPORT_FILE)
        return None, [DataValidationError(report)]
    if (repeated := _duplicate_rows(dataset)) is not None:  # reported, not refused: upsampling repeats rows
        report.rules.append(repeated)
        report.write_json(report_dir / REPORT_FILE)
    if readers and report.format is not None and "label" in report.format.columns:
        report.rules.append(_unpaired_for(readers, len(dataset)))
        report.write_json(report_dir / REPORT_FILE)
        return None, [DataValidationError(report)]
    return (Split(name, kind, spec.path, dataset), report), []


def _held_out_leaks(passed: dict[str, tuple], report_dir: Path) -> list[ValueError]:
    """Train/eval leakage: each held-out dataset against the datasets trained beside it; one that leaks fails (and is
    dropped from `passed`). A dataset that failed its own rules is already reported. No held-out dataset is trained
    on, so dropping one that leaks changes no other check: all of them run at once, each training set read once."""
    from rlhf_pipeline.validators.leakage import check_leakages
    from rlhf_pipeline.validators.report import DataValidationError
    from rlhf_pipeline.validators.validate import REPORT_FILE

    failures: list[ValueError] = []
    checks = {
        held_out: (passed[held_out][0], [passed[name][0] for name in trained if name in passed])
        for held_out, trained in HELD_OUT.items()
        if held_out in passed and any(name in passed for name in trained)
    }
    for held_out, result in zip(checks, check_leakages(list(checks.values()))):
        report = passed[held_out][1]
        report.rules.append(result)
        report.write_json(report_dir / held_out / REPORT_FILE)
        if not report.success:
            failures.append(DataValidationError(report))
            del passed[held_out]
    return failures


def _benchmark_leaks(passed: dict[str, tuple], benchmarks: tuple[str, ...], report_dir: Path) -> list[ValueError]:
    """Rule `no_benchmark_prompt_in_training` on every dataset trained on, for each benchmark eval scores (`benchmarks`:
    keys of `trainers.evaluation.instructions.BENCHMARKS`): all of its test prompts, the ones this machine cannot check
    too. A dataset is checked against every benchmark, then one that broke the rule fails (and is dropped from
    `passed`)."""
    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, benchmark_file
    from rlhf_pipeline.validators.leakage import check_benchmark_leakage
    from rlhf_pipeline.validators.report import DataValidationError
    from rlhf_pipeline.validators.validate import REPORT_FILE

    failures: list[ValueError] = []
    trained = sorted({name for names in HELD_OUT.values() for name in names})
    tests = []
    for key in benchmarks:
        path, rows = benchmark_file(BENCHMARKS[key])
        tests.append((BENCHMARKS[key].name, str(path), [row["prompt"] for row in rows]))
    for name in [name for name in trained if name in passed]:
        split, report = passed[name]
        report.rules.extend(check_benchmark_leakage(split, *test) for test in tests)
        report.write_json(report_dir / name / REPORT_FILE)
        if not report.success:
            failures.append(DataValidationError(report))
            del passed[name]
    return failures


DUPLICATES = "no_duplicate_rows"


def _duplicate_rows(dataset, batch_rows: int = 200_000):
    """Rule `no_duplicate_rows`, reported and never refused (a file upsampled on purpose repeats rows): the rows equal
    in every column to an earlier row, each named with that row; None when there are none. Rows are compared by a
    64-bit hash of their values, a batch at a time (8 bytes a row in memory)."""
    import json

    import numpy as np
    import pandas as pd
    import pyarrow as pa

    from rlhf_pipeline.validators.report import MAX_EXAMPLES, RuleResult

    table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
    if table.num_rows < 2:
        return None
    hashes = np.empty(table.num_rows, dtype=np.uint64)
    for start in range(0, table.num_rows, batch_rows):
        batch = table.slice(start, batch_rows)
        columns = {
            name: [json.dumps(value, sort_keys=True, ensure_ascii=False) for value in column.to_pylist()]
            if pa.types.is_nested(column.type)
            else column.to_pandas()
            for name, column in zip(batch.column_names, batch.columns)
        }
        hashes[start : start + batch.num_rows] = pd.util.hash_pandas_object(pd.DataFrame(columns), index=False)
    # Rows in hash order, equal hashes in row order (a stable sort): a row whose hash equals the one before it in
    # that order repeats an earlier row, the first of its run. Three arrays of 8 bytes a row, none kept.
    order = np.argsort(hashes, kind="stable")
    hashes = hashes[order]
    repeated = np.flatnonzero(hashes[1:] == hashes[:-1]) + 1  # positions in `order`
    if not len(repeated):
        return None
    starts = np.flatnonzero(np.r_[True, hashes[1:] != hashes[:-1]])  # where each run of equal hashes starts
    first = order[starts[np.searchsorted(starts, repeated, side="right") - 1]]
    rows = order[repeated]
    shown = np.argsort(rows)[:MAX_EXAMPLES]  # the earliest repeats first
    return RuleResult(
        DUPLICATES,
        "rows should not repeat an earlier row exactly (reported; the data stage keeps them)",
        True,
        len(repeated),
        [{"row": int(rows[i]), "value": f"same as row {int(first[i])}"} for i in shown],
    )


def _finite_numbers(dataset):
    """Rule `finite_numbers`, or None when it holds: no NaN or Infinity in any number column (a score or reference a
    reward function reads would turn every comparison false and every mean NaN)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from rlhf_pipeline.validators.report import MAX_EXAMPLES, RuleResult

    table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
    examples: list[dict] = []
    failed = 0
    for column in table.column_names:
        values = table.column(column)
        if not pa.types.is_floating(values.type):
            continue
        bad = pc.fill_null(pc.or_(pc.is_nan(values), pc.is_inf(values)), False)
        rows = pc.indices_nonzero(bad).to_pylist()
        failed += len(rows)
        examples += [{"row": row, "value": f"{column} is {values[row].as_py()}"} for row in rows]
    if not failed:
        return None
    examples.sort(key=lambda example: example["row"])
    return RuleResult(
        "finite_numbers",
        "every number must be finite (no NaN or Infinity)",
        False,
        failed,
        examples[:MAX_EXAMPLES],
    )


def _required_columns(name: str, missing: list[str], found: list[str], num_rows: int):
    """Rule `required_columns`: the run's gate reads a metric that needs these columns (exact match: the reference
    answers)."""
    from rlhf_pipeline.validators.report import RuleResult

    why = (
        f"no column {missing} (columns: {found}); the run's registry gate needs it: set eval.answer_column or "
        "registry.gate_metric"
    )
    return RuleResult(
        "required_columns",
        f"{name} must have the columns {missing} the run's gate metric reads",
        False,
        num_rows,
        [{"row": 0, "value": why}],
    )


def _unpaired_for(readers: tuple[str, ...], num_rows: int):
    """Rule `paired_for_readers`: rm and dpo compare a chosen with a rejected answer; unpaired rows have neither."""
    from rlhf_pipeline.validators.report import RuleResult

    why = (
        f"an unpaired row (prompt/completion/label), but {', '.join(readers)} of this run need pairs "
        "(prompt/chosen/rejected)"
    )
    return RuleResult(
        "paired_for_readers",
        f"rows are preference pairs, as {', '.join(readers)} read them; unpaired feedback trains algorithm=kto (with "
        "eval.use_reward_model=false, no rm)",
        False,
        num_rows,
        [{"row": row, "value": why} for row in range(min(num_rows, 5))],
    )
