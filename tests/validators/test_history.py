"""Great Expectations as designed (validators/suite.py): a file context keeps every validation in its history, a
Checkpoint's UpdateDataDocsAction renders Data Docs that speak of the dataset's own columns, through GX's public API."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from rlhf_pipeline.validators import DataValidationError, validate_dataset

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [{"prompt": f"sort {n}1 -> ", "chosen": f"1{n}", "rejected": f"{n}1"} for n in range(2, 9)]


def validate(rows: list[dict] | datasets.Dataset, project, report_dir: Path, source: str = "data/pairs.jsonl"):
    """validate_dataset through the file context under `project`; the report, whether it passed or not."""
    try:
        return validate_dataset(
            "preference",
            rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(rows),
            source=source,
            report_dir=report_dir,
            name="preference",
            gx_project=project,
        )
    except DataValidationError as failed:
        return failed.report


def results(project: Path) -> list[Path]:
    return sorted((project / "gx" / "uncommitted" / "validations" / "preference").rglob("*.json"))


def site_page(url: str) -> Path:
    return Path(url.removeprefix("file://"))


def test_two_validations_leave_two_results_in_the_history_and_the_index_lists_both(tmp_path):
    project = tmp_path / "state"
    first = validate(PAIRS, project, tmp_path / "run1")
    [stored] = results(project)
    kept, page = stored.read_bytes(), Path(first.data_docs).read_bytes()
    broken = [dict(PAIRS[0], rejected=PAIRS[0]["chosen"]), *PAIRS[1:]]
    second = validate(broken, project, tmp_path / "run2")
    assert first.success and not second.success

    assert len(results(project)) == 2  # one per run, under its own run time
    assert stored.read_bytes() == kept  # the first run's result is never rewritten
    assert [json.loads(path.read_text())["success"] for path in results(project)] == [True, False]
    index = (project / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html").read_text()
    for report in (first, second):
        assert report.history is not None and site_page(report.history).is_file()
        relative = site_page(report.history).relative_to(project / "gx" / "uncommitted" / "data_docs" / "local_site")
        assert str(relative) in index  # the history site's index links every run's page
    # Each run's own pages sit beside its report (logged to MLflow with it), the first run's untouched by the second.
    assert Path(first.data_docs).is_relative_to(tmp_path / "run1" / "data_docs")
    assert Path(first.data_docs).read_bytes() == page
    assert Path(second.data_docs).is_relative_to(tmp_path / "run2" / "data_docs") and Path(second.data_docs).is_file()


def test_a_run_of_several_datasets_builds_the_history_sites_index_once_and_every_page(tmp_path, monkeypatch):
    """Issue 45: the data stage's datasets share one History, and its Data Docs are built once when it closes (a
    Checkpoint's UpdateDataDocsAction rebuilt the index once per dataset); a dataset that failed has its pages too."""
    from great_expectations.render.renderer.site_builder import DefaultSiteIndexBuilder

    from rlhf_pipeline.validators.suite import History

    builds = []
    build = DefaultSiteIndexBuilder.build
    monkeypatch.setattr(
        DefaultSiteIndexBuilder, "build", lambda self, *a, **k: builds.append(1) or build(self, *a, **k)
    )
    project = tmp_path / "state"
    broken = [dict(PAIRS[0], rejected=PAIRS[0]["chosen"]), *PAIRS[1:]]
    with History(project) as history:
        reports = [
            validate(rows, history, tmp_path / name, source=f"data/{name}.jsonl")
            for name, rows in (("first", PAIRS), ("second", broken), ("third", PAIRS[:4]))
        ]
        assert builds == [] and not any(Path(report.data_docs).exists() for report in reports)
    assert len(builds) == 1
    assert [report.success for report in reports] == [True, False, True]
    index = (project / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html").read_text()
    for name, report in zip(("first", "second", "third"), reports):
        assert Path(report.data_docs).is_relative_to(tmp_path / name / "data_docs") and Path(report.data_docs).is_file()
        relative = site_page(report.history).relative_to(project / "gx" / "uncommitted" / "data_docs" / "local_site")
        assert str(relative) in index


def test_data_docs_show_the_datasets_own_columns(tmp_path):
    rows = [*PAIRS[:3], dict(PAIRS[3], chosen=""), dict(PAIRS[4], prompt=None)]
    report = validate(rows, tmp_path / "state", tmp_path / "run")
    failed = {rule.rule: (rule.failed_count, [e["row"] for e in rule.examples]) for rule in report.failed_rules}
    assert failed == {"consistent_types": (1, [4]), "text_not_blank": (1, [3])}
    page = Path(report.data_docs).read_text()
    headings = [re.sub(r"<[^>]+>|\s+", "", h) for h in re.findall(r"<h\d[^>]*>(.*?)</h\d>", page, re.S)]
    assert {"prompt", "chosen", "rejected"} <= set(headings)  # sections named after the dataset's columns
    # GX's own expectations on those columns, and what they found.
    stored = json.loads(results(tmp_path / "state")[0].read_text())
    native = {
        (r["expectation_config"]["type"], r["expectation_config"]["kwargs"]["column"]): r["result"]["unexpected_count"]
        for r in stored["results"]
        if r["expectation_config"]["kwargs"].get("column") in ("prompt", "chosen", "rejected")
    }
    assert native == {("expect_column_value_lengths_to_be_between", column): 0 for column in ("prompt", "rejected")} | {
        ("expect_column_value_lengths_to_be_between", "chosen"): 1  # row 3's empty text; GX skips row 4's None
    }


def test_runs_that_share_the_state_folder_at_once_each_keep_their_result(tmp_path):
    """Two processes validate through one file context at the same time: the lock makes them take turns, and the
    history holds both results, its config still readable."""
    script = (
        "import sys, datasets\n"
        "from pathlib import Path\n"
        "from tests.validators.test_history import PAIRS, validate\n"
        "report = validate(PAIRS, Path(sys.argv[1]), Path(sys.argv[2]), source=sys.argv[3])\n"
        "assert report.success, report.summary()\n"
    )
    project = tmp_path / "state"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(project), str(tmp_path / f"run{i}"), f"data/p{i}.jsonl"], cwd=ROOT
        )
        for i in range(2)
    ]
    assert [run.wait(timeout=300) for run in runs] == [0, 0]
    assert len(results(project)) == 2
    validate(PAIRS, project, tmp_path / "run3")  # the context the two left behind still loads and validates
    assert len(results(project)) == 3


def test_no_validation_without_a_project_persists_anything(tmp_path):
    report = validate_dataset("preference", datasets.Dataset.from_list(PAIRS), source="p.jsonl", report_dir=tmp_path)
    assert report.history is None and Path(report.data_docs) == tmp_path / "data_docs" / "index.html"
    assert not (tmp_path / "gx").exists()


def test_only_public_great_expectations_apis_are_used():
    """No private GX attribute (`_merge`, `remove_key` of a store, ...) and GX imported only from its public modules,
    in the one validators module that imports it."""

    def imports(path: Path) -> set[str]:
        return {
            name
            for node in ast.walk(ast.parse(path.read_text()))
            for name in (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in getattr(node, "names", [])]
            )
            if isinstance(node, (ast.Import, ast.ImportFrom))
        }

    importers = sorted(
        path.name
        for path in (ROOT / "validators").glob("*.py")
        if any(name.startswith("great_expectations") for name in imports(path))
    )
    assert importers == ["suite.py"]
    tree = ast.parse((ROOT / "validators" / "suite.py").read_text())
    private = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_")]
    assert private == []
    calls = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not calls & {"remove_key", "set", "validation_results_store"}
    # The one Data Docs build of a run (issue 45) names this run's pages: never a rebuild of the whole history.
    builds = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "build_data_docs"
    ]
    assert len(builds) == 1 and {keyword.arg for keyword in builds[0].keywords} >= {"resource_identifiers"}
    modules = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and "great_expectations" in node.module
    }
    assert modules <= {
        "great_expectations.checkpoint",
        "great_expectations.core.run_identifier",
        "great_expectations.exceptions",
        "great_expectations.data_context.types.base",  # ProgressBarsConfig: great_expectations.yml's progress_bars
    }, modules


@pytest.mark.parametrize("rows", [PAIRS, datasets.Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})])
def test_the_history_site_renders_an_empty_or_a_full_dataset(rows, tmp_path):
    report = validate(rows, tmp_path / "state", tmp_path / "run")
    assert report.success == bool(len(rows))
    assert [rule.rule for rule in report.failed_rules] == ([] if len(rows) else ["non_empty_dataset"])
    assert report.history is not None and site_page(report.history).is_file()
