"""Running the rules as a Great Expectations suite, and rendering its Data Docs.

Everything GX lives here and is imported inside the functions: importing
great_expectations takes seconds, and `import validators` must stay cheap.

A dataset is validated one record batch at a time: `Suite.validate` runs the suite on each batch's
frame of derived scalars (GX judges every row), the batch results fold into one validation result
(counts summed, offending rows listed in dataset order) and `Suite.finish` renders that result's
Data Docs once.
"""

from __future__ import annotations

import logging
import pathlib
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.validators.rules import Derived, Rule

if TYPE_CHECKING:
    import pandas as pd

ROW_ID = "row"  # explicit 0-based row index column, so GX reports offending rows by it
DOCS_SITE = "report"
# COMPLETE lists every offending row; the ROW_ID column names them.
RESULT_FORMAT = {"result_format": "COMPLETE", "unexpected_index_column_names": [ROW_ID]}
PARTIAL = 20  # GX's partial_unexpected_count: the values a result's "partial" lists show
MAX_LISTED = 1000
"""Offending rows the merged result keeps per rule; its counts stay exact. The report quotes five,
and a Data Docs page listing a million rows helps nobody."""


@dataclass
class Outcome:
    success: bool
    failed_count: int
    rows: list[int]
    """The offending 0-based dataset rows GX reported, in order (the first MAX_LISTED)."""


@dataclass
class SuiteRun:
    outcomes: dict[str, Outcome]
    """Rule name -> what GX found."""
    data_docs: pathlib.Path | None
    """index.html of the rendered Data Docs, when a report directory was given."""


def derived_frame(derived: Derived, rules: list[Rule], num_rows: int, start: int = 0) -> pd.DataFrame:
    """The derived scalars of dataset rows start .. start + num_rows - 1 as a DataFrame, with dtypes GX judges reliably
    and fast.

    Counts are int64, or nullable Int64 where some row has none (GX then compares in Python, ~1 µs a
    row); flags and roles are categoricals, whose in-set check runs at C speed (pandas 3 turns
    strings into its `str` dtype, which GX's type expectations misread; object columns cost ~1 µs a row).
    """
    import numpy as np
    import pandas as pd

    rows = pd.RangeIndex(start, start + num_rows)  # so that GX's unexpected_index_query names dataset rows too
    frame = pd.DataFrame({ROW_ID: np.arange(start, start + num_rows, dtype=np.int64)}, index=rows)
    for rule in rules:
        if rule.column is None:
            continue
        values = derived.columns[rule.column]
        if rule.expect in ("at_least_one", "at_most"):
            counts = (
                values
                if isinstance(values, np.ndarray) and values.dtype.kind == "i"
                else pd.array(values, dtype="Int64")
            )
            frame[rule.column] = pd.Series(
                counts if counts.dtype.kind == "i" or counts.isna().any() else counts.to_numpy("int64"), index=rows
            )
        else:
            frame[rule.column] = pd.Series(pd.Categorical(values), index=rows)
    return frame


class Suite:
    """One expectation per rule, run on a dataset's batches: `validate` each frame of derived scalars, then `finish`
    once."""

    def __init__(self, kind: str, rules: list[Rule], *, source: str, docs_dir: pathlib.Path | None = None) -> None:
        gx = _import_great_expectations()
        from great_expectations.core.run_identifier import RunIdentifier
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self.kind, self.docs_dir = kind, docs_dir
        self.context = gx.get_context(mode="ephemeral")
        # Without this every run draws tqdm "Calculating Metrics" bars on stderr.
        self.context.variables.progress_bars = ProgressBarsConfig(globally=False)
        batch = (
            self.context.data_sources.add_pandas("derived")
            .add_dataframe_asset(kind)
            .add_batch_definition_whole_dataframe("all rows")
        )
        suite = self.context.suites.add(gx.ExpectationSuite(name=kind, expectations=[_expectation(r) for r in rules]))
        self.definition = self.context.validation_definitions.add(
            gx.ValidationDefinition(name=kind, data=batch, suite=suite)
        )
        self.run_id = RunIdentifier(run_name=_run_name(source))
        self.outcomes: dict[str, Outcome] = {}
        self.result = None
        """Every batch's ExpectationSuiteValidationResult so far, folded into one (`_merge`)."""

    def validate(self, frame: pd.DataFrame) -> dict[str, Outcome]:
        """Run the suite on one batch; returns that batch's outcomes (ROW_ID rows) and folds them into the dataset's."""
        result = self.definition.run(
            batch_parameters={"dataframe": frame}, result_format=RESULT_FORMAT, run_id=self.run_id
        )
        outcomes = _outcomes(result)
        self.result = result if self.result is None else _merge(self.result, result)
        for rule, outcome in outcomes.items():
            total = self.outcomes.setdefault(rule, Outcome(True, 0, []))
            total.success = total.success and outcome.success
            total.failed_count += outcome.failed_count
            total.rows += outcome.rows[: MAX_LISTED - len(total.rows)]
        return outcomes

    def finish(self) -> SuiteRun:
        """The dataset's outcomes; renders the merged result's Data Docs into docs_dir when it was given."""
        if self.result is None:
            raise ValueError(
                "no batch was validated: an empty dataset is one empty batch (validators.formats.record_batches)"
            )
        return SuiteRun(self.outcomes, None if self.docs_dir is None else self._render(self.docs_dir))

    def _render(self, docs_dir: pathlib.Path) -> pathlib.Path:
        """Store the merged result in place of the batches' and build a filesystem Data Docs site from it.

        An ephemeral context keeps its stores in memory, but a filesystem Data Docs site still works:
        the site renders the stored result (and the suite) to static HTML.
        """
        from great_expectations.data_context.types.resource_identifiers import (
            ExpectationSuiteIdentifier,
            ValidationResultIdentifier,
        )

        docs_dir.mkdir(parents=True, exist_ok=True)
        for name in list(self.context.list_data_docs_sites()):
            self.context.delete_data_docs_site(name)  # the default site points at a throwaway temp dir
        self.context.add_data_docs_site(
            DOCS_SITE,
            {
                "class_name": "SiteBuilder",
                "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            },
        )
        store = self.context.validation_results_store
        for key in store.list_keys():  # each batch stored its own result; the docs show the dataset's
            store.remove_key(key)
        assert self.result is not None, "finish() renders the docs of a validated suite"
        suite_id = ExpectationSuiteIdentifier(name=self.kind)
        key = ValidationResultIdentifier(
            expectation_suite_identifier=suite_id, run_id=self.run_id, batch_identifier=self.result.batch_id
        )
        store.set(key, self.result)
        self.context.build_data_docs(site_names=[DOCS_SITE], resource_identifiers=[key, suite_id])
        _prune_unused_images(docs_dir)
        return docs_dir / "index.html"


def _import_great_expectations():
    # GX logs ~200 INFO lines while registering its classes at import, and its
    # fluent datasources import the deprecated sre_* modules: keep both out of
    # the pipeline's logs unless someone configured the GX logger on purpose.
    gx_logger = logging.getLogger("great_expectations")
    ours = gx_logger.level == logging.NOTSET
    if ours:
        gx_logger.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import great_expectations
    if (
        ours
    ):  # one module sets its own logger to INFO at import: "Created temporary directory ... for ephemeral docs site"
        logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.NOTSET)

    return great_expectations


def _prune_unused_images(docs_dir: pathlib.Path) -> None:
    # GX copies 3.4 MB of tutorial GIFs into every site that no page shows;
    # a report is written per stage run, so keep only what the pages reference.
    pages = "".join(path.read_text(errors="ignore") for path in docs_dir.rglob("*.html"))
    pages += "".join(path.read_text(errors="ignore") for path in docs_dir.rglob("*.css"))
    for image in (docs_dir / "static" / "images").glob("*"):
        if image.is_file() and image.name not in pages:
            image.unlink()


def _run_name(source: str) -> str:
    # The run name becomes a folder of the docs site, and GX refuses keys holding "/" or "\\".
    return re.sub(r"[^A-Za-z0-9._-]+", "_", source).strip("_") or "dataset"


def _expectation(rule: Rule):
    import great_expectations.expectations as gxe

    common: dict[str, Any] = {"description": rule.description, "meta": {"rule": rule.name}}
    if rule.column is None:  # the only table-level rule: non_empty_dataset
        return gxe.ExpectTableRowCountToBeBetween(min_value=1, **common)
    if rule.expect == "at_least_one":
        return gxe.ExpectColumnValuesToBeBetween(column=rule.column, min_value=1, **common)
    if rule.expect == "at_most":
        return gxe.ExpectColumnValuesToBeBetween(column=rule.column, min_value=0, max_value=rule.max_value, **common)
    return gxe.ExpectColumnValuesToBeInSet(column=rule.column, value_set=list(rule.value_set), **common)


def _outcomes(result) -> dict[str, Outcome]:
    outcomes = {}
    for expectation_result in result.results:
        rule = expectation_result.expectation_config.meta["rule"]
        info = expectation_result.exception_info or {}
        if info.get("raised_exception"):
            # A GX failure is a bug here, not bad data: surface it instead of a failed rule.
            raise RuntimeError(f"Great Expectations could not evaluate rule {rule!r}: {info.get('exception_message')}")
        details = expectation_result.result or {}
        rows = [int(item[ROW_ID]) for item in details.get("unexpected_index_list") or []]
        outcomes[rule] = Outcome(
            success=bool(expectation_result.success),
            failed_count=int(details.get("unexpected_count") or 0),
            rows=rows,
        )
    return outcomes


def _merge(total, batch):
    """Fold one batch's suite result into the dataset's: every expectation must pass in every batch
    (the only empty batch is an empty dataset's, which the row count fails), counts add up and the
    offending values and rows follow in dataset order, up to MAX_LISTED."""
    for into, part in zip(total.results, batch.results, strict=True):
        into.success = bool(into.success and part.success)
        merged, new = into.result, part.result or {}
        if "observed_value" in merged:  # the table-level row count
            merged["observed_value"] += new.get("observed_value") or 0
            continue
        for name in ("element_count", "unexpected_count", "missing_count"):
            if name in merged:
                merged[name] = (merged[name] or 0) + (new.get(name) or 0)
        for name in ("unexpected_list", "unexpected_index_list"):
            if name in merged:
                merged[name] = (merged[name] + (new.get(name) or []))[:MAX_LISTED]
        _restate(merged)
    passed = sum(bool(result.success) for result in total.results)
    total.success = passed == len(total.results)
    evaluated = len(total.results)
    total.statistics = {
        "evaluated_expectations": evaluated,
        "successful_expectations": passed,
        "unsuccessful_expectations": evaluated - passed,
        "success_percent": 100 * passed / evaluated if evaluated else None,
    }
    return total


def _restate(result: dict) -> None:
    """The figures GX derives from a map expectation's counts and lists (as _format_map_output does), for merged
    counts."""
    elements, unexpected, missing = (
        result.get("element_count") or 0,
        result.get("unexpected_count") or 0,
        result.get("missing_count") or 0,
    )
    present = elements - missing
    if elements:
        result["unexpected_percent_total"] = unexpected / elements * 100
        result["missing_percent"] = missing / elements * 100
    result["unexpected_percent"] = result["unexpected_percent_nonmissing"] = (
        unexpected / present * 100 if present else None
    )
    values, rows = result.get("unexpected_list", []), result.get("unexpected_index_list", [])
    result["partial_unexpected_list"] = values[:PARTIAL]
    result["partial_unexpected_index_list"] = rows[:PARTIAL]
    try:
        common = sorted(Counter(values).most_common(PARTIAL), key=lambda item: (-item[1], item[0]))
        result["partial_unexpected_counts"] = [{"value": value, "count": count} for value, count in common]
    except TypeError:
        result["partial_unexpected_counts"] = [{"error": "partial_exception_counts requires a hashable type"}]
    if "unexpected_index_query" in result:
        result["unexpected_index_query"] = f"df.filter(items={[int(row[ROW_ID]) for row in rows]}, axis=0)"
