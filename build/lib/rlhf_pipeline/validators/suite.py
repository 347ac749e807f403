"""Running the rules as a Great Expectations suite, and rendering its Data Docs.

Everything GX lives here and is imported inside the functions: importing
great_expectations takes seconds, and `import validators` must stay cheap.
"""

from __future__ import annotations

import logging
import pathlib
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.validators.rules import Derived, Rule

if TYPE_CHECKING:
    import pandas as pd

ROW_ID = "row"  # explicit 0-based row index column, so GX reports offending rows by it
DOCS_SITE = "report"


@dataclass
class Outcome:
    success: bool
    failed_count: int
    rows: list[int]
    """Every offending 0-based row index GX reported, in order."""


@dataclass
class SuiteRun:
    outcomes: dict[str, Outcome]
    """Rule name -> what GX found."""
    data_docs: pathlib.Path | None
    """index.html of the rendered Data Docs, when a report directory was given."""


def derived_frame(derived: Derived, rules: list[Rule], num_rows: int) -> pd.DataFrame:
    """The derived scalars as a DataFrame, with dtypes GX judges reliably.

    Counts are nullable Int64 and flags/roles are object columns: pandas 3 turns
    strings into its `str` dtype, which GX's type expectations misread.
    """
    import pandas as pd

    frame = pd.DataFrame({ROW_ID: pd.RangeIndex(num_rows)})
    for rule in rules:
        if rule.column is None:
            continue
        values = derived.columns[rule.column]
        dtype = "Int64" if rule.expect in ("at_least_one", "at_most") else object
        frame[rule.column] = pd.Series(values, dtype=dtype, index=frame.index)
    return frame


def run_suite(
    kind: str,
    frame: pd.DataFrame,
    rules: list[Rule],
    *,
    source: str,
    docs_dir: pathlib.Path | None = None,
) -> SuiteRun:
    """Validate `frame` with one expectation per rule; render Data Docs into `docs_dir` if given."""
    gx = _import_great_expectations()
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # Without this every run draws tqdm "Calculating Metrics" bars on stderr.
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = context.data_sources.add_pandas("derived").add_dataframe_asset(kind).add_batch_definition_whole_dataframe("all rows")
    suite = context.suites.add(gx.ExpectationSuite(name=kind, expectations=[_expectation(r) for r in rules]))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=kind, data=batch, suite=suite))
    # COMPLETE lists every offending row; the ROW_ID column names them.
    result_format = {"result_format": "COMPLETE", "unexpected_index_column_names": [ROW_ID]}

    if docs_dir is None:
        result = definition.run(batch_parameters={"dataframe": frame}, result_format=result_format)
        index_html = None
    else:
        result, index_html = _run_with_data_docs(context, definition, frame, result_format, source, docs_dir)
    return SuiteRun(_outcomes(result), index_html)


def _import_great_expectations():
    # GX logs ~200 INFO lines while registering its classes at import, and its
    # fluent datasources import the deprecated sre_* modules: keep both out of
    # the pipeline's logs unless someone configured the GX logger on purpose.
    gx_logger = logging.getLogger("great_expectations")
    if gx_logger.level == logging.NOTSET:
        gx_logger.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import great_expectations

    return great_expectations


def _run_with_data_docs(context, definition, frame, result_format, source, docs_dir):
    """Run through a Checkpoint whose UpdateDataDocsAction renders into `docs_dir`.

    An ephemeral context keeps its stores in memory, but a filesystem Data Docs
    site still works: the checkpoint puts the result in the in-memory results
    store and the action renders it (and the suite) to static HTML.
    """
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.core.run_identifier import RunIdentifier

    docs_dir.mkdir(parents=True, exist_ok=True)
    for name in list(context.list_data_docs_sites()):
        context.delete_data_docs_site(name)  # the default site points at a throwaway temp dir
    context.add_data_docs_site(
        DOCS_SITE,
        {
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name=definition.name,
            validation_definitions=[definition],
            actions=[UpdateDataDocsAction(name="data_docs", site_names=[DOCS_SITE])],
            result_format=result_format,
        )
    )
    checkpoint_result = checkpoint.run(batch_parameters={"dataframe": frame}, run_id=RunIdentifier(run_name=_run_name(source)))
    (result,) = checkpoint_result.run_results.values()
    _prune_unused_images(docs_dir)
    return result, docs_dir / "index.html"


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
