"""validate_dataset: detect the format, then per record batch derive the scalar columns and run the GX suite; report."""

from __future__ import annotations

import contextlib
import pathlib
from typing import TYPE_CHECKING, Any, Callable

from rlhf_pipeline.validators.formats import BATCH_ROWS, Batch, Kind, detect_format, record_batches
from rlhf_pipeline.validators.lengths import count_tokens, fits_max_length
from rlhf_pipeline.validators.report import MAX_EXAMPLES, DataValidationError, RuleResult, ValidationReport
from rlhf_pipeline.validators.rules import CHECKS, TOOLS_RENDERED, Rule, label_checks, rules_for
from rlhf_pipeline.validators.screen import derive_batch
from rlhf_pipeline.validators.suite import Frame, History, Native, run_suite
from rlhf_pipeline.validators.template_rules import (
    chat_template_rule,
    end_of_turn_rule,
    template_column,
    template_problem,
    untrained_end_of_turns,
)

if TYPE_CHECKING:
    import datasets

REPORT_FILE = "validation.json"
DATA_DOCS_DIR = "data_docs"

# A rule computed beside the rules' own columns: batch -> (one value per row, local row -> why it fails).
Extra = Callable[[Batch], "tuple[list[Any], dict[int, str]]"]


def validate_dataset(
    kind: Kind,
    dataset: datasets.Dataset,
    *,
    source: str,
    report_dir: pathlib.Path | None = None,
    max_tokens: int | None = None,
    tokenizer: Any = None,
    model_name: str = "the model",
    assistant_only: bool = False,
    batch_rows: int = BATCH_ROWS,
    name: str | None = None,
    gx_project: pathlib.Path | History | None = None,
) -> ValidationReport:
    """Check `dataset` against the rules for its kind and format.

    With `max_tokens`, rule `fits_max_length` also counts every row's tokens
    with `tokenizer` (see validators.lengths). Conversational rows with a
    `tokenizer` also get rule `chat_template` (it has one that can train them, with
    {% generation %} marks when `assistant_only`) and, with `assistant_only`, rule
    `end_of_turn_trained` (see validators.template_rules).
    The rows are read `batch_rows` at a time, so memory does not grow with the dataset; the report
    names offending rows by their 0-based dataset index whatever the batch.
    Writes report_dir/validation.json and report_dir/data_docs/ (GX Data Docs)
    when report_dir is given, whether validation passes or not. The suite is named `name` (default: the kind);
    with `gx_project` (a folder, or a `History` already open on one), GX's file context under `gx_project/gx/` keeps
    it and this validation in its history (validators.suite), else an ephemeral context validates. Returns the
    report when every rule passes; raises DataValidationError (with .report)
    naming the source, the failed rules and example rows otherwise.
    """
    if max_tokens is not None and tokenizer is None:
        raise ValueError(f"max_tokens={max_tokens} needs the tokenizer that counts the tokens")
    report_dir = None if report_dir is None else pathlib.Path(report_dir)
    try:
        fmt = detect_format(kind, dataset, source, batch_rows)
    except DataValidationError as error:
        _write(error.report, report_dir)
        raise

    own = rules_for(fmt)
    extras = _tokenizer_rules(fmt, tokenizer, model_name, assistant_only, max_tokens)
    rules = own + [rule for rule, _ in extras]
    # The unpaired label rules compare rows across the dataset: one pass first collects what they need.
    checks = (
        {**CHECKS, **label_checks(fmt, (batch.values for batch in record_batches(dataset, fmt.columns, batch_rows)))}
        if fmt.unpaired
        else None
    )
    if "tool_calls" in (getattr(tokenizer, "chat_template", None) or ""):  # the template renders tool calls
        checks = {**(checks or CHECKS), **TOOLS_RENDERED}

    docs_dir = None if report_dir is None else report_dir / DATA_DOCS_DIR
    native = native_expectations(fmt, dataset, rules)
    frame = Frame(rules, own=sorted({expectation.column for expectation in native}))
    kept = _derive(dataset, fmt, own, extras, checks, frame, batch_rows)
    with History(gx_project) if isinstance(gx_project, pathlib.Path) else contextlib.nullcontext(gx_project) as history:
        run = run_suite(
            name or kind, rules, frame.frame(), source=source, native=native, docs_dir=docs_dir, history=history
        )

    results = [_result(rule, run.outcomes[rule.name], kept[rule.name]) for rule in rules]
    data_docs = None if run.data_docs is None else str(run.data_docs)
    report = ValidationReport(source, kind, fmt, len(dataset), results, data_docs=data_docs, history=run.history)
    _write(report, report_dir)
    if not report.success:
        raise DataValidationError(report)
    return report


def _tokenizer_rules(fmt, tokenizer, model_name: str, assistant_only: bool, max_tokens: int | None):
    """The rules that need the tokenizer, each with what derives its column from a batch: the chat template (nothing
    can be counted without one: report why, not a tokenizer exception per row), the trained end of turn
    (`assistant_only`), and the token length."""
    extras: list[tuple[Rule, Extra]] = []
    sft_turns = assistant_only and fmt.kind == "sft"
    problem = (
        template_problem(tokenizer, model_name, sft_turns) if fmt.conversational and tokenizer is not None else None
    )
    if problem is not None:
        extras.append((chat_template_rule(), lambda batch: template_column(batch.num_rows, problem, start=batch.start)))
    elif fmt.conversational and tokenizer is not None and sft_turns:
        extras.append((end_of_turn_rule(), lambda batch: untrained_end_of_turns(fmt, batch.values, tokenizer)))
    if max_tokens is not None and problem is None:
        extras.append(
            (fits_max_length(fmt, max_tokens), lambda batch: count_tokens(fmt, batch.values, tokenizer, max_tokens))
        )
    return extras


def _derive(dataset, fmt, own: list[Rule], extras: list, checks, frame: Frame, batch_rows: int) -> dict:
    """Every batch's derived columns into `frame`. GX runs once over the whole dataset's frame; explanations live as
    long as their batch, so each rule keeps those of its first offending rows (the rows GX names first: it lists them
    in dataset order). Returns rule -> row -> explanation."""
    rules = own + [rule for rule, _ in extras]
    kept: dict[str, dict[int, str]] = {rule.name: {} for rule in rules}
    for batch in record_batches(dataset, fmt.columns, batch_rows):
        derived = derive_batch(fmt, batch, own, checks)
        for rule, extra in extras:
            derived.columns[rule.column], why = extra(batch)
            derived.explanations[rule.name] = {batch.start + row: text for row, text in why.items()}
        frame.add(derived, batch.num_rows, batch.table)
        for rule in rules:
            room = MAX_EXAMPLES - len(kept[rule.name])
            if room > 0:
                why = derived.explanations.get(rule.name, {})
                kept[rule.name].update((row, why[row]) for row in sorted(why)[:room])
    return kept


def _result(rule: Rule, outcome, kept: dict[int, str]) -> RuleResult:
    """A rule's outcome, with its first offending rows and why each offends."""
    examples = [{"row": row, "value": kept.get(row, "(no explanation)")} for row in outcome.rows[:MAX_EXAMPLES]]
    return RuleResult(rule.name, rule.description, outcome.success, outcome.failed_count, examples)


def _write(report: ValidationReport, report_dir: pathlib.Path | None) -> None:
    if report_dir is not None:
        report.write_json(report_dir / REPORT_FILE)


def native_expectations(fmt, dataset: datasets.Dataset, rules: list[Rule]) -> list[Native]:
    """GX's own expectations on the dataset's own columns, one a column, each part of a rule, so that the Data Docs
    speak of `prompt` and `chosen`, not only of derived flags. Each fails only on rows its rule's derived column
    fails too: an empty text is a blank one (`text_not_blank`, whose derived column also catches whitespace-only texts;
    GX's length check skips missing values, which `consistent_types` reports), and a missing value is a type error
    (`consistent_types`; a missing label, `label_is_boolean`). One a column: each adds rows to every Data Docs page,
    and rendering those pages is most of the data stage's time on small datasets."""
    import pyarrow as pa

    names = {rule.name for rule in rules}
    schema = dataset.data.schema
    found: list[Native] = []
    for column in fmt.columns:
        arrow_type = schema.field(column).type
        is_text = pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
        rule = "label_is_boolean" if column == "label" else "consistent_types"
        if "text_not_blank" in names and is_text and not fmt.conversational and column in fmt.text_columns:
            found.append(Native("not_empty", column, "text_not_blank"))
        elif rule in names:
            found.append(Native("not_null", column, rule))
    return found
