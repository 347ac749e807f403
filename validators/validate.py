"""validate_dataset: detect the format, derive the scalar columns, run the GX suite, report."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.validators.formats import Kind, read_format
from rlhf_pipeline.validators.lengths import count_tokens, fits_max_length
from rlhf_pipeline.validators.report import MAX_EXAMPLES, DataValidationError, RuleResult, ValidationReport
from rlhf_pipeline.validators.rules import derive, rules_for
from rlhf_pipeline.validators.suite import derived_frame, run_suite
from rlhf_pipeline.validators.template import chat_template_rule, end_of_turn_rule, template_column, template_problem, untrained_end_of_turns

if TYPE_CHECKING:
    import datasets

REPORT_FILE = "validation.json"
DATA_DOCS_DIR = "data_docs"


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
) -> ValidationReport:
    """Check `dataset` against the rules for its kind and format.

    With `max_tokens`, rule `fits_max_length` also counts every row's tokens
    with `tokenizer` (see validators.lengths). Conversational rows with a
    `tokenizer` also get rule `chat_template` (it has one that can train them, with
    {% generation %} marks when `assistant_only`) and, with `assistant_only`, rule
    `end_of_turn_trained` (see validators.template).
    Writes report_dir/validation.json and report_dir/data_docs/ (GX Data Docs)
    when report_dir is given, whether validation passes or not. Returns the
    report when every rule passes; raises DataValidationError (with .report)
    naming the source, the failed rules and example rows otherwise.
    """
    if max_tokens is not None and tokenizer is None:
        raise ValueError(f"max_tokens={max_tokens} needs the tokenizer that counts the tokens")
    report_dir = None if report_dir is None else pathlib.Path(report_dir)
    try:
        fmt, values = read_format(kind, dataset, source)
    except DataValidationError as error:
        _write(error.report, report_dir)
        raise

    rules = rules_for(fmt)
    derived = derive(fmt, values, rules)
    problem = template_problem(tokenizer, model_name, assistant_only and fmt.kind == "sft") if fmt.conversational and tokenizer is not None else None
    if problem is not None:  # nothing can be counted without a template: report why, not a tokenizer exception per row
        rule = chat_template_rule()
        derived.columns[rule.column], derived.explanations[rule.name] = template_column(len(dataset), problem)
        rules.append(rule)
    elif fmt.conversational and tokenizer is not None and assistant_only and fmt.kind == "sft":
        rule = end_of_turn_rule()
        derived.columns[rule.column], derived.explanations[rule.name] = untrained_end_of_turns(fmt, values, tokenizer)
        rules.append(rule)
    if max_tokens is not None and problem is None:
        rule = fits_max_length(fmt, max_tokens)
        derived.columns[rule.column], derived.explanations[rule.name] = count_tokens(fmt, values, tokenizer, max_tokens)
        rules.append(rule)
    frame = derived_frame(derived, rules, num_rows=len(dataset))
    docs_dir = None if report_dir is None else report_dir / DATA_DOCS_DIR
    run = run_suite(kind, frame, rules, source=source, docs_dir=docs_dir)

    results = []
    for rule in rules:
        outcome = run.outcomes[rule.name]
        why = derived.explanations.get(rule.name, {})
        examples = [{"row": row, "value": why.get(row, "(no explanation)")} for row in outcome.rows[:MAX_EXAMPLES]]
        results.append(RuleResult(rule.name, rule.description, outcome.success, outcome.failed_count, examples))
    data_docs = None if run.data_docs is None else str(run.data_docs)
    report = ValidationReport(source, kind, fmt, len(dataset), results, data_docs=data_docs)
    _write(report, report_dir)
    if not report.success:
        raise DataValidationError(report)
    return report


def _write(report: ValidationReport, report_dir: pathlib.Path | None) -> None:
    if report_dir is not None:
        report.write_json(report_dir / REPORT_FILE)
