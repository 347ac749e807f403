"""The `rlhf` command as a user meets it: wrong model URIs, fresh folders, state beside the working directory."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rlhf_pipeline.cli import main
from tests.flows.helpers import CI_PRESET


@pytest.mark.parametrize(
    "uri", ["models:/rlhf-policy", "models:/rlhf-policy/", "models:/rlhf-policy/latest", "models:/@champion"]
)
def test_eval_of_a_registry_uri_without_version_or_alias_exits_2_showing_the_accepted_forms(uri, capsys):
    assert main(["eval", uri]) == 2
    err = capsys.readouterr().err
    assert f"{uri!r} names no version or alias" in err
    assert "models:/<name>/<version>" in err and "models:/<name>@<alias>" in err and "a model folder" in err


@pytest.mark.parametrize(
    "model", ["/no/such/folder", "/no/such/model.gguf", "models:/no-such-model@champion", "models:/no-such-model/3"]
)
def test_eval_of_a_model_that_does_not_exist_says_so_in_seconds_before_any_server_starts(model, tmp_path):
    import time

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline", "eval", model],
        env={**os.environ, "RLHF_STATE_DIR": str(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"policy model {model!r}" in done.stderr and "does not exist" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "temporary Prefect server" not in done.stderr, done.stderr
    assert time.monotonic() - started < 20


def test_a_model_folder_no_stage_wrote_is_evaluated_through_a_link_keyed_by_its_content(tmp_path, monkeypatch):
    """A hub download or a GGUF's converted folder is not a stage artifact (`<ref>/model`): `rlhf eval` reads it
    through `inputs/<digest>/model` in the run state, a link to the folder itself."""
    from rlhf_pipeline.tasks.store.artifacts import content_digest
    from rlhf_pipeline.tasks.tracking.resolve import resolve_model
    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.load import save_model
    from tests.helpers import SMALL_MODEL

    monkeypatch.setenv("RLHF_MODEL_CACHE", str(tmp_path / "models"))
    folder = save_model(*load_base_model(SMALL_MODEL), tmp_path / "SmallLM-hub-download")
    ref, lineage = resolve_model(str(folder), "policy")
    assert lineage == {} and (ref.path / "model").resolve() == folder.resolve()
    assert ref.digest == content_digest(folder) and ref.path.parent == tmp_path / "models" / "inputs"
    assert resolve_model(str(folder), "sft")[0].path == ref.path  # the same folder, the same input
    (folder / "generation_config.json").write_text("{}")  # another content: another input
    assert resolve_model(str(folder), "policy")[0].digest != ref.digest


def test_rlhf_run_with_invalid_parameters_exits_2_with_garbage_collection_on_again(capsys, monkeypatch):
    """`rlhf run` turns the garbage collector off while it imports (startup.settle_heap): every way out turns it on."""
    import gc

    from rlhf_pipeline import startup

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # no temporary server for parameters that fail
    # No console bars: their handler would outlive the test, writing to pytest's captured (then closed) stderr.
    monkeypatch.setattr(startup, "console", lambda args: None)
    assert gc.isenabled()
    assert main(["run", "--set", "sft.max_steps=-1"]) == 2
    assert "1 problem with the parameters" in capsys.readouterr().err
    assert gc.isenabled()


def test_the_state_folder_is_beside_the_working_directory(tmp_path, monkeypatch):
    from rlhf_pipeline.tasks.tracking import client as tracking

    monkeypatch.delenv(tracking.STATE_ENV)
    monkeypatch.chdir(tmp_path)
    assert tracking.state_dir() == tmp_path / "state"
    monkeypatch.setenv(tracking.STATE_ENV, str(tmp_path / "elsewhere"))
    assert tracking.state_dir() == tmp_path / "elsewhere"


def assert_a_clean_console(stdout: str, stderr: str, trained: list[str]) -> None:
    """What `rlhf run` shows a person (issue 16): one bar per training stage, none of the libraries' bars, printed log
    dicts or FutureWarnings, no progress line twice, and the closing table with the held-out figures."""
    terminal = stdout + stderr
    # What stays on screen of each line a bar redraws with \r
    shown = [line.rsplit("\r", 1)[-1] for line in terminal.split("\n")]
    assert "it/s]" not in terminal and "examples/s]" not in terminal, "a library's tqdm bar"  # ours count steps
    assert not [line for line in shown if line.lstrip().startswith("{'")], "a printed log dict"
    assert "FutureWarning" not in terminal and "rlhf_pipeline.trainers.runtime.progress" not in terminal
    assert "great_expectations" not in terminal and "MLflow database tables" not in terminal, "a library's INFO log"
    for stage in trained:  # one bar each: it starts once and ends full (in a pipe, tqdm writes each refresh as a line)
        bars = [line for line in shown if line.startswith(f"{stage}: ")]
        assert len([line for line in bars if " 0%|" in line]) == 1 and "100%" in bars[-1] and "step/s" in bars[-1], (
            stage,
            bars,
        )
    table = stdout[stdout.index("== finished ==") :]
    for stage in ("data", *trained, "eval"):
        assert any(line.split()[:2] == [stage, "Completed"] for line in table.splitlines()), (stage, table)
    exact = next(line for line in table.splitlines() if line.startswith("exact match: policy"))
    assert "[" in exact and "]" in exact, exact  # with its 95% interval
    assert "MLflow run:" in table and "hacking warnings" in table


def progress_in_the_prefect_ui(database: Path) -> dict[str, int]:
    """The progress lines of each stage in the logs the Prefect UI shows: the temporary server's store, read after the
    run."""
    with contextlib.closing(sqlite3.connect(database)) as store:
        query = "SELECT message FROM log WHERE name = 'rlhf_pipeline.trainers.runtime.progress'"
        rows = store.execute(query).fetchall()
    return dict(Counter(message.split(":", 1)[0] for (message,) in rows if ": step " in message))


@pytest.mark.slow
def test_rlhf_run_creates_prefect_home_state_and_tracking_folders_that_do_not_exist(tmp_path):
    fresh = tmp_path / "not" / "there" / "yet"
    env = {
        **os.environ,
        "PREFECT_HOME": str(fresh / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(fresh / "prefect" / "storage"),
        "RLHF_STATE_DIR": str(fresh / "state"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{fresh / 'mlflow' / 'mlflow.db'}",
    }
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline", "run", "--config", CI_PRESET, "--set", "registry.enabled=false"],
        env=env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_a_clean_console(done.stdout, done.stderr, ["sft", "rm", "dpo"])
    assert (fresh / "mlflow" / "mlflow.db").is_file()
    assert {p.name for p in (fresh / "state" / "artifacts").iterdir()} >= {"data", "sft", "rm", "dpo", "eval"}
    assert any((fresh / "prefect").iterdir())
    ui = progress_in_the_prefect_ui(fresh / "prefect" / "prefect.db")
    assert all(ui.get(stage, 0) >= 2 for stage in ("sft", "rm", "dpo")), ui  # kept off the terminal, not off the UI
    assert not (elsewhere / "state").exists()  # RLHF_STATE_DIR wins over ./state


def test_the_closing_table_shows_figures_with_and_without_intervals_and_names_the_benchmark_samples():
    from rlhf_pipeline.console import closing_table

    held, ifeval = "eval/heldout/", "eval/ifeval/"
    metrics = {
        f"{held}num_prompts": 50.0,
        f"{held}policy_exact_match": 0.9,
        f"{held}policy_exact_match_low": 0.82,
        f"{held}policy_exact_match_high": 0.96,
        f"{held}exact_match_gain_vs_sft": 0.3,
        f"{held}exact_match_gain_vs_sft_low": 0.2,
        f"{held}exact_match_gain_vs_sft_high": 0.4,
        f"{held}kl_to_sft": 1.25,  # no interval
        f"{ifeval}num_prompts": 30.0,
        f"{ifeval}num_total": 541.0,
        f"{ifeval}num_refused": 0.0,
        f"{ifeval}sample_seed": 0.0,
        f"{ifeval}num_ids": 25.0,
        f"{ifeval}num_ids_total": 25.0,
        f"{ifeval}if_prompt_strict_gain": -0.05,
        f"{ifeval}if_prompt_strict_gain_low": -0.15,
        f"{ifeval}if_prompt_strict_gain_high": 0.05,
    }
    summary = {"metrics": metrics, "artifacts": {"eval": "/x"}, "stages": {"eval": {"state": None}}, "mlflow": "m"}
    table = closing_table(summary)
    assert "exact match: gain over sft" in table and "+0.300  [+0.200, +0.400]" in table, table
    assert [line for line in table.splitlines() if line.startswith("KL(policy || sft)")][0].rstrip().endswith("1.250")
    assert "IFEval (30 of 541, seed 0)" in table and "-0.050  [-0.150, +0.050]" in table, table
    assert any(line.split()[:2] == ["eval", "-"] for line in table.splitlines()), table
