"""The validation report, its rule results and the error raised when a rule fails.

Plain dataclasses with no heavy imports: the report travels to MLflow and the
artifact directory as `validation.json`, and its `summary()` is the markdown
table the pipeline publishes as a Prefect artifact.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rlhf_pipeline.validators.formats import DatasetFormat

MAX_EXAMPLES = 5  # rows kept per failed rule in the report
MESSAGE_EXAMPLES = 3  # rows quoted per failed rule in the exception message


@dataclass
class RuleResult:
    rule: str
    """Stable rule name, e.g. `chosen_differs_from_rejected`."""
    description: str
    """What the rule requires, in English ("chosen must differ from rejected")."""
    success: bool
    failed_count: int
    """Rows that broke the rule (0 for table-level rules such as `non_empty_dataset`)."""
    examples: list[dict[str, Any]] = field(default_factory=list)
    """Up to MAX_EXAMPLES `{"row": 0-based dataset index, "value": short explanation}`
    (`{"line": 1-based line, ...}` in a raw-file report)."""


@dataclass
class ValidationReport:
    source: str
    """Where the data came from (a path or hub id); every message starts with it."""
    kind: str
    format: DatasetFormat | None
    """None when the columns or types fit no format TRL can use (rule `format`)."""
    num_rows: int
    rules: list[RuleResult]
    data_docs: str | None = None
    """Path of this validation's Great Expectations Data Docs page (an index.html, or the page copied beside the
    report from the history site), when they were built."""
    history: str | None = None
    """file:// URL of this validation's page in the state folder's GX Data Docs site, whose index lists every run
    (the data stage's file context; validators.suite)."""
    unit: Literal["row", "line"] = "row"
    """What num_rows and the examples count: 0-based dataset rows, or the
    1-based lines of a file (validators.files checks a file before it is parsed)."""

    @property
    def success(self) -> bool:
        return all(result.success for result in self.rules)

    @property
    def failed_rules(self) -> list[RuleResult]:
        return [result for result in self.rules if not result.success]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["success"] = self.success
        return data

    def write_json(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")

    def summary(self) -> str:
        """A short markdown table of the rules, for Prefect artifacts and MLflow."""
        if self.unit == "line":
            shape = "raw file"
        else:
            shape = "no usable format" if self.format is None else self.format.describe()
        verdict = "passed" if self.success else f"FAILED {len(self.failed_rules)} of {len(self.rules)} rules"
        lines = [
            f"**{self.source}** ({shape}, {self.num_rows} {self.unit}s): {verdict}",
            "",
            f"| rule | result | failed {self.unit}s | requirement |",
            "|---|---|---:|---|",
        ]
        for result in self.rules:
            outcome = "pass" if result.success else "**FAIL**"
            lines.append(f"| `{result.rule}` | {outcome} | {result.failed_count} | {_cell(result.description)} |")
        return "\n".join(lines)

    def failure_message(self) -> str:
        """One line per failed rule, naming the source, the rule and example rows."""
        lines = []
        # "(0-based)" is said once, at the first row quoted; lines need no note
        # (1-based, as editors number them).
        rows_explained = self.unit == "line"
        for result in self.failed_rules:
            if result.rule == "format":
                lines.append(f"{self.source}: rule 'format' failed: {result.description}")
                continue
            line = f"{self.source}: rule '{result.rule}' failed"
            if result.failed_count:
                line += f" for {result.failed_count} of {self.num_rows} {self.unit}s"
            line += f" ({result.description})"
            if result.examples:
                quoted = []
                for example in result.examples[:MESSAGE_EXAMPLES]:
                    base = "" if rows_explained else " (0-based)"
                    rows_explained = True
                    quoted.append(f"{self.unit} {example[self.unit]}{base}: {example['value']}")
                line += ", e.g. " + "; ".join(quoted)
            elif result.failed_count == 0:
                holder = "file" if self.unit == "line" else "dataset"
                plural = "" if self.num_rows == 1 else "s"
                line += f": the {holder} has {self.num_rows} {self.unit}{plural}"
            lines.append(line)
        if self.data_docs:
            lines.append(f"Data Docs: {self.data_docs}")
        return "\n".join(lines)


class DataValidationError(ValueError):
    """Raised when a dataset breaks a rule; str() names the source, the rule and example rows.

    A ValueError so that the pipeline's retry policy treats it as permanent.
    """

    def __init__(self, report: ValidationReport) -> None:
        self.report = report
        super().__init__(report.failure_message())


def short_repr(value: Any, limit: int = 60) -> str:
    """repr() cut to `limit` characters, so one huge row cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
