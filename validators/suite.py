"""Running the rules as a Great Expectations checkpoint, and rendering its Data Docs.

Everything GX lives here and is imported inside the functions: importing
great_expectations takes seconds, and `import validators` must stay cheap.

A dataset's rules become one expectation suite, validated once over the whole dataset: a frame of
the derived scalars (`Frame`, built a record batch at a time, a few bytes a row) beside the dataset's
own columns as zero-copy views of its Arrow data. A GX Checkpoint runs the suite's validation
definition; an ephemeral context's UpdateDataDocsAction renders its Data Docs, and a file context's site is built
once per run, for all its validations together, when the run's `History` closes. Through public GX APIs only.

Two contexts (docs/ARCHITECTURE.md, Great Expectations):
- a file context under a project folder (the data stage passes the state folder: `<state>/gx/`): suites,
  validation definitions, checkpoints and every run's validation result persist, and the site under
  `gx/uncommitted/data_docs/local_site/` lists the history of every dataset's validations. Runs that share
  the folder take turns through a file lock; each run's result is stored under its own run time.
  This run's pages are copied beside the report (`docs_dir`), so the report folder stands alone;
- an ephemeral one otherwise (`rlhf check`, the pairs stage): nothing persists, and the Data Docs, when
  `docs_dir` is given, are a site of their own there.
"""

from __future__ import annotations

import logging
import pathlib
import re
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from rlhf_pipeline.validators.rules import Derived, Rule

if TYPE_CHECKING:
    import pandas as pd

DOCS_SITE = "report"
HISTORY_SITE = "local_site"  # the site GX scaffolds in a new file context
DATA_SOURCE = "rlhf"
LOCK = "rlhf.lock"
HISTORY_LISTED = 25
"""Validations the history site's index lists, newest first (five data stage runs of five datasets; older pages and
results stay): GX reads each listed result again whenever it rebuilds the index, once per dataset and run (~2 ms
each here)."""
ROWS_LISTED = 20
"""Offending rows GX lists per expectation (its `partial_unexpected_count`); its counts stay exact. The report quotes
five, and a Data Docs page listing a million rows helps nobody."""
RESULT_FORMAT = {"result_format": "SUMMARY", "partial_unexpected_count": ROWS_LISTED}
"""SUMMARY, not COMPLETE: GX then keeps the first ROWS_LISTED offending rows of each expectation, named by the frame's
index (the 0-based dataset row), so a rule that fails on every row of a big dataset costs no per-row list."""


@dataclass(frozen=True)
class Native:
    """One of GX's own expectations on a column of the dataset itself, part of `rule`."""

    expect: str
    """"not_null" (ExpectColumnValuesToNotBeNull) or "not_empty" (ExpectColumnValueLengthsToBeBetween, min 1)."""
    column: str
    rule: str


@dataclass
class Outcome:
    success: bool
    failed_count: int
    rows: list[int]
    """The first offending 0-based dataset rows GX reported (up to ROWS_LISTED), in order."""


@dataclass
class SuiteRun:
    outcomes: dict[str, Outcome]
    """Rule name -> what GX found (its expectations together)."""
    data_docs: pathlib.Path | None
    """The rendered Data Docs page of this validation in `docs_dir` (index.html of an ephemeral site), when given."""
    history: str | None = None
    """file:// URL of this validation's page in the file context's Data Docs site, whose index lists every run."""


class Frame:
    """The derived scalars of a dataset, a record batch at a time (`add`), then one DataFrame (`frame`): counts int64
    (nullable Int64 where some row has none: GX then compares in Python, ~1 µs a row), flags and roles categoricals,
    whose in-set check runs at C speed (pandas 3 turns strings into its `str` dtype, which GX's type expectations
    misread; object columns cost ~1 µs a row). The dataset's own columns join as Arrow-backed views (`own`)."""

    def __init__(self, rules: list[Rule], own: list[str] | None = None) -> None:
        self.rules = [rule for rule in rules if rule.column is not None]
        self.chunks: dict[str, list[Any]] = {rule.column: [] for rule in self.rules if rule.column}
        self.own: dict[str, list[Any]] = {column: [] for column in own or []}
        self.num_rows = 0

    def add(self, derived: Derived, num_rows: int, table=None) -> None:
        """One batch's derived columns (and, from its Arrow `table`, the dataset's own columns)."""
        import numpy as np
        import pandas as pd

        for rule in self.rules:
            assert rule.column is not None
            values = derived.columns[rule.column]
            if rule.expect in ("at_least_one", "at_most"):
                if not (isinstance(values, np.ndarray) and values.dtype.kind == "i"):
                    values = pd.array(values, dtype="Int64")
                self.chunks[rule.column].append(values)
            else:
                self.chunks[rule.column].append(pd.Categorical(values))
        for column, chunks in self.own.items():
            chunks.append(table.column(column))
        self.num_rows += num_rows

    def frame(self) -> pd.DataFrame:
        import pandas as pd
        import pyarrow as pa
        from pandas.api.types import union_categoricals

        rows = pd.RangeIndex(self.num_rows)  # GX names offending rows by the index: dataset rows
        columns: dict[str, Any] = {}
        for rule in self.rules:
            chunks = self.chunks[rule.column]  # type: ignore[index]
            if rule.expect in ("at_least_one", "at_most"):
                counts = pd.concat(
                    [pd.Series([], dtype="Int64"), *(pd.Series(chunk, dtype="Int64") for chunk in chunks)],
                    ignore_index=True,
                )
                columns[rule.column] = (counts if counts.isna().any() else counts.astype("int64")).set_axis(rows)
            else:
                # Batches may hold categories of different dtypes (a bool array, then Python objects): as objects.
                values = (
                    union_categoricals(
                        [pd.Categorical.from_codes(c.codes, c.categories.astype(object)) for c in chunks]
                    )
                    if chunks
                    else pd.Categorical([])
                )
                columns[rule.column] = pd.Series(values, index=rows)  # type: ignore[index]
        for column, chunks in self.own.items():
            # An extension type (datasets' Json) by its storage: GX reads nulls and lengths, which it keeps.
            arrays = [a.storage if isinstance(a, pa.ExtensionArray) else a for c in chunks for a in c.chunks]
            values = pa.chunked_array(arrays, type=arrays[0].type if arrays else pa.null())
            # Texts as pandas' Arrow-backed string array (no copy either): GX fingerprints every batch under 1 GB
            # with pandas' hash_pandas_object, which hashes these twice as fast as the generic Arrow dtype's.
            text = pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
            view = pd.arrays.ArrowStringArray(values) if text else pd.arrays.ArrowExtensionArray(values)
            columns[column] = pd.Series(view, index=rows)
        return pd.DataFrame(columns, index=rows)


def run_suite(
    name: str,
    rules: list[Rule],
    frame: pd.DataFrame,
    *,
    source: str,
    native: Sequence[Native] = (),
    docs_dir: pathlib.Path | None = None,
    history: History | None = None,
) -> SuiteRun:
    """Validate `frame` with one expectation per rule (on its derived column) and the `native` expectations on the
    dataset's own columns, through a Checkpoint; returns each rule's outcome.

    `history`: the open file context that keeps this validation (`History`); None: an ephemeral context.
    `docs_dir`: where this run's Data Docs go (None: no Data Docs).
    """
    gx = _import_great_expectations()
    expectations = [_expectation(rule) for rule in rules] + [_native(expectation) for expectation in native]
    belongs = [rule.name for rule in rules] + [expectation.rule for expectation in native]
    context = _ephemeral(gx) if history is None else history.context
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.exceptions import DataContextError

    sites = _sites(context, docs_dir, history is not None)
    # The history site is built once when the run's History closes (`History.build_docs`); an ephemeral site here.
    actions = [UpdateDataDocsAction(name="data_docs", site_names=sites)] if sites and history is None else []
    asset_name = _key(name)
    # The suite is written every run (its rules follow the run's settings); its validation definition and checkpoint,
    # which name it, only when they are missing or differ: each write rewrites their JSON files.
    suite = context.suites.add_or_update(gx.ExpectationSuite(name=asset_name, expectations=expectations))
    try:
        checkpoint = context.checkpoints.get(asset_name)
        stale = checkpoint.actions != actions or checkpoint.result_format != RESULT_FORMAT
    except DataContextError:
        stale = True
    if stale:
        definition = context.validation_definitions.add_or_update(
            gx.ValidationDefinition(name=asset_name, data=_batch_definition(context, asset_name), suite=suite)
        )
        checkpoint = context.checkpoints.add_or_update(
            gx.Checkpoint(
                name=asset_name, validation_definitions=[definition], actions=actions, result_format=RESULT_FORMAT
            )
        )
    checkpoint_result = checkpoint.run(
        batch_parameters={"dataframe": frame}, run_id=RunIdentifier(run_name=_key(source))
    )
    [(key, result)] = checkpoint_result.run_results.items()
    outcomes = _outcomes(result, belongs)
    if docs_dir is None or not sites:
        return SuiteRun(outcomes, None)
    if history is None:
        _prune_unused_images(docs_dir)
        return SuiteRun(outcomes, docs_dir / "index.html")
    return SuiteRun(outcomes, *history.docs_later(key, docs_dir))


class History:
    """GX's file context under `project/gx/`, open for one data stage run: suites, validation definitions, checkpoints
    and every validation result persist there, and its Data Docs site lists them. Runs that share the state folder
    take turns through a file lock held while it is open (GX rewrites its config files whole)."""

    def __init__(self, project: pathlib.Path) -> None:
        self.project = pathlib.Path(project)
        self.context: Any = None
        self.lock: Any = None
        self.pending: list[tuple[Any, str, pathlib.Path]] = []
        """(validation result id, page URL, docs_dir) of each validation whose pages are not built yet."""

    def __enter__(self) -> History:
        from filelock import FileLock

        gx = _import_great_expectations()
        folder = self.project / "gx"
        folder.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(folder / LOCK)
        self.lock.acquire()
        try:
            self.context = gx.get_context(mode="file", project_root_dir=self.project)
            _quiet(self.context)
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, kind, value, traceback) -> None:
        try:
            # A dataset that failed its rules has its pages too; an interrupted run builds nothing.
            if kind is None or issubclass(kind, Exception):
                self.build_docs()
        finally:
            self.context = None
            self.lock.release()

    def docs_later(self, key, docs_dir: pathlib.Path) -> tuple[pathlib.Path, str]:
        """Note a validation whose pages `build_docs` renders; returns where its page will be copied in docs_dir and
        its page's file:// URL in the history site."""
        [url] = [
            site["site_url"]
            for site in self.context.get_docs_sites_urls(
                resource_identifier=key, site_name=HISTORY_SITE, only_if_exists=False
            )
        ]
        self.pending.append((key, url, docs_dir))
        page = _site_page(url)
        return docs_dir / page.relative_to(_site_of(page)), url

    def build_docs(self) -> None:
        """The history site's pages of every validation since the last build (each with its suite's page) and its index,
        in one build (GX's UpdateDataDocsAction builds the index once per validation), then each run's pages copied
        beside its report."""
        if not self.pending:
            return
        identifiers = [identifier for key, *_ in self.pending for identifier in (key, key.expectation_suite_identifier)]
        self.context.build_data_docs(site_names=[HISTORY_SITE], resource_identifiers=identifiers)
        for key, url, docs_dir in self.pending:
            _copy_pages(url, key.expectation_suite_identifier.name, docs_dir)
        self.pending.clear()


def _ephemeral(gx):
    context = gx.get_context(mode="ephemeral")
    _quiet(context)
    return context


def _quiet(context) -> None:
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # great_expectations.yml's `progress_bars`: without it every run draws tqdm "Calculating Metrics" bars on stderr.
    context.variables.progress_bars = ProgressBarsConfig(globally=False)


def _batch_definition(context, asset_name: str):
    """The whole-dataframe batch definition of the asset named for the dataset, in the `rlhf` pandas data source; what
    exists is read, not written again."""
    try:
        source = context.data_sources.get(DATA_SOURCE)
    except KeyError:
        source = context.data_sources.add_pandas(DATA_SOURCE)
    try:
        asset = source.get_asset(asset_name)
    except LookupError:
        asset = source.add_dataframe_asset(asset_name)
    try:
        return asset.get_batch_definition("all rows")
    except KeyError:
        return asset.add_batch_definition_whole_dataframe("all rows")


def _sites(context, docs_dir: pathlib.Path | None, persistent: bool) -> list[str]:
    """The Data Docs sites this run updates: the file context's own (history), or a site of its own in docs_dir."""
    if docs_dir is None:
        return []
    if persistent:
        # The index lists the newest HISTORY_LISTED validations: GX's index builder reads every result it lists, so
        # an unbounded index would cost each run time in proportion to all runs before it. Older pages stay.
        site = {
            "class_name": "SiteBuilder",
            "show_how_to_buttons": False,
            "store_backend": {
                "class_name": "TupleFilesystemStoreBackend",
                "base_directory": f"uncommitted/data_docs/{HISTORY_SITE}/",
            },
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder", "validation_results_limit": HISTORY_LISTED},
        }
        sites = context.list_data_docs_sites()
        if HISTORY_SITE not in sites:
            context.add_data_docs_site(HISTORY_SITE, site)
        elif sites[HISTORY_SITE] != site:
            context.update_data_docs_site(HISTORY_SITE, site)
        return [HISTORY_SITE]
    docs_dir.mkdir(parents=True, exist_ok=True)
    for site in list(context.list_data_docs_sites()):
        context.delete_data_docs_site(site)  # the default site points at a throwaway temp dir
    context.add_data_docs_site(
        DOCS_SITE,
        {
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )
    return [DOCS_SITE]


def _copy_pages(url: str, suite: str, docs_dir: pathlib.Path) -> pathlib.Path:
    """This run's pages of the history site (its validation and its suite, with the styles they read) into docs_dir,
    at the same relative places, so that the report folder (and its MLflow copy) shows them on its own. Returns the
    copied validation page."""
    page = _site_page(url)
    site = _site_of(page)
    suite_page = site / "expectations" / f"{suite}.html"
    docs_dir.mkdir(parents=True, exist_ok=True)
    for path in (page, suite_page):
        if path.is_file():
            target = docs_dir / path.relative_to(site)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    shutil.copytree(site / "static", docs_dir / "static", dirs_exist_ok=True)
    _prune_unused_images(docs_dir)
    return docs_dir / page.relative_to(site)


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
    # One module sets its own logger to INFO at import: "Created temporary directory ... for ephemeral docs site"
    if ours:
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


def _key(text: str) -> str:
    # Names become folders of the docs site and store keys: GX refuses keys holding "/" or "\\", and a folder name
    # has at most 255 bytes (the end of a long path names the file).
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-120:] or "dataset"


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


def _native(native: Native):
    import great_expectations.expectations as gxe

    common: dict[str, Any] = {"column": native.column, "meta": {"rule": native.rule}}
    if native.expect == "not_null":
        return gxe.ExpectColumnValuesToNotBeNull(**common)
    return gxe.ExpectColumnValueLengthsToBeBetween(min_value=1, **common)


def _outcomes(result, belongs: list[str]) -> dict[str, Outcome]:
    """Each rule's outcome from its expectations' results (in the suite's order, `belongs[i]` the rule of the i-th):
    it fails when one of them fails, with the most offending rows any of them counted, listed in dataset order."""
    by_rule = {}
    for expectation_result in result.results:
        rule = expectation_result.expectation_config.meta["rule"]
        info = expectation_result.exception_info or {}
        if info.get("raised_exception"):
            # A GX failure is a bug here, not bad data: surface it instead of a failed rule.
            raise RuntimeError(f"Great Expectations could not evaluate rule {rule!r}: {info.get('exception_message')}")
        details = expectation_result.result or {}
        rows = [int(row) for row in details.get("partial_unexpected_index_list") or []]
        outcome = Outcome(bool(expectation_result.success), int(details.get("unexpected_count") or 0), rows)
        if rule in by_rule:
            total = by_rule[rule]
            total.success = total.success and outcome.success
            total.failed_count = max(total.failed_count, outcome.failed_count)
            total.rows = sorted(set(total.rows) | set(outcome.rows))[:ROWS_LISTED]
        else:
            by_rule[rule] = outcome
    missing = set(belongs) - set(by_rule)
    assert not missing, f"GX returned no result for rules {sorted(missing)}"
    return by_rule


def _site_page(url: str) -> pathlib.Path:
    return pathlib.Path(unquote(urlparse(url).path))


def _site_of(page: pathlib.Path) -> pathlib.Path:
    return next(parent for parent in page.parents if parent.name == HISTORY_SITE)
