"""validate_dataset: detect the format, then per record batch derive the scalar columns and run the GX suite; report."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any, Callable

from rlhf_pipeline.validators.formats import BATCH_ROWS, Batch, Kind, detect_format, record_batches
from rlhf_pipeline.validators.lengths import count_tokens, fits_max_length
from rlhf_pipeline.validators.report import MAX_EXAMPLES, DataValidationError, RuleResult, ValidationReport
from rlhf_pipeline.validators.rules import CHECKS, TOOLS_RENDERED, Rule, label_checks, rules_for
from rlhf_pipeline.validators.screen import derive_batch
from rlhf_pipeline.validators.suite import Suite, derived_frame
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
    when report_dir is given, whether validation passes or not. Returns the
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
    extras: list[tuple[Rule, Extra]] = []
    problem = (
        template_problem(tokenizer, model_name, assistant_only and fmt.kind == "sft")
        if fmt.conversational and tokenizer is not None
        else None
    )
    if problem is not None:  # nothing can be counted without a template: report why, not a tokenizer exception per row
        extras.append((chat_template_rule(), lambda batch: template_column(batch.num_rows, problem, start=batch.start)))
    elif fmt.conversational and tokenizer is not None and assistant_only and fmt.kind == "sft":
        extras.append((end_of_turn_rule(), lambda batch: untrained_end_of_turns(fmt, batch.values, tokenizer)))
    if max_tokens is not None and problem is None:
        extras.append(
            (fits_max_length(fmt, max_tokens), lambda batch: count_tokens(fmt, batch.values, tokenizer, max_tokens))
        )
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
    suite = Suite(kind, rules, source=source, docs_dir=docs_dir)
    examples: dict[str, list[dict[str, Any]]] = {rule.name: [] for rule in rules}
    for batch in record_batches(dataset, fmt.columns, batch_rows):
        derived = derive_batch(fmt, batch, own, checks)
        for rule, extra in extras:
            derived.columns[rule.column], why = extra(batch)
            derived.explanations[rule.name] = {batch.start + row: text for row, text in why.items()}
        outcomes = suite.validate(derived_frame(derived, rules, batch.num_rows, start=batch.start))
        # Explanations live as long as their batch: keep those of the first offending rows GX names.
        for rule in rules:
            kept, why = examples[rule.name], derived.explanations.get(rule.name, {})
            kept += [
                {"row": row, "value": why.get(row, "(no explanation)")}
                for row in outcomes[rule.name].rows[: MAX_EXAMPLES - len(kept)]
            ]
    run = suite.finish()

    results = []
    for rule in rules:
        outcome = run.outcomes[rule.name]
        results.append(
            RuleResult(rule.name, rule.description, outcome.success, outcome.failed_count, examples[rule.name])
        )
    data_docs = None if run.data_docs is None else str(run.data_docs)
    report = ValidationReport(source, kind, fmt, len(dataset), results, data_docs=data_docs)
    _write(report, report_dir)
    if not report.success:
        raise DataValidationError(report)
    return report


def _write(report: ValidationReport, report_dir: pathlib.Path | None) -> None:
    if report_dir is not None:
        report.write_json(report_dir / REPORT_FILE)
