"""A newcomer's mistakes (issue 44, finding 3), each said with the parameters: one readable line per problem, a
"did you mean" for an unknown key, the way to a TRL argument, a missing data file before any server or run starts,
and a preflight (`rlhf check`) that lists problems and never ends in a traceback. Also the help a newcomer reads
first: `rlhf run --help` and `rlhf params --explain`."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlhf_pipeline.cli import main
from rlhf_pipeline.tasks.stages import ALGORITHMS


def refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and "errors.pydantic.dev" not in err, err
    return err


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("dpo.betaa=0.2", "dpo.betaa: unknown field of dpo (did you mean `dpo.beta`?)"),
        ("dpoo.beta=0.2", "dpoo: unknown field of the parameters (did you mean `dpo`?)"),
        (
            "sft.num_train_epochs=3",
            "sft.num_train_epochs: not a field of sft: the pipeline counts training in optimizer steps, `sft.max_st",
        ),
        (
            "dpo.adam_beta2=0.95",
            "not a field of dpo, but an argument of trl.DPOConfig: give it through the block's trl_overrides, "
            "--set dpo.trl_overrides.adam_beta2=VALUE",
        ),
        ("dpo.output_dir=/tmp/x", "TRL's output_dir is set by the pipeline"),
        (
            "sft.activation_checkpointing=true",
            "TRL's activation_checkpointing is this block's `sft.gradient_checkpointing`",
        ),
        ("sft.lr=1e-4", "sft.lr: not a field of sft: the same thing here is `sft.learning_rate`"),
        ("sft.learning_rate=-1", "sft.learning_rate: input should be greater than 0 (got -1)"),
    ],
)
def test_each_parameter_mistake_is_one_line_naming_the_key_and_what_to_set_instead(given, says, capsys):
    err = refused(capsys, ["params", "--set", given])
    assert says in err, err
    assert "1 problem with the parameters" in err, err


def test_two_mistakes_are_two_lines(capsys):
    err = refused(capsys, ["params", "--set", "dpo.betaa=0.2", "--set", "sft.max_stepz=3"])
    assert "2 problems with the parameters" in err
    assert "dpo.betaa:" in err and "sft.max_stepz: unknown field of sft (did you mean `sft.max_steps`?)" in err


def test_a_missing_data_file_stops_rlhf_run_in_seconds_before_any_server_or_run(tmp_path):
    """A real `rlhf run`: exit 2 naming the field and the file, no temporary server announced, no MLflow store made."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline", "run", "--set", "data.preference.path=data/no-such-prefs.jsonl"],
        env={
            **os.environ,
            "RLHF_STATE_DIR": str(tmp_path / "state"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "PREFECT_HOME": str(tmp_path / "prefect"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "data.preference.path: data/no-such-prefs.jsonl: no such file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "temporary Prefect server" not in done.stderr, done.stderr
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run was made, not even a failed one
    assert time.monotonic() - started < 30


def test_rlhf_check_lists_a_missing_file_and_a_pattern_that_matches_nothing_without_a_traceback(capsys):
    code = main(
        ["check", "--set", "data.preference.path=data/no-such.jsonl", "--set", "data.prompts.path=data/none-*.jsonl"]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "Traceback" not in out
    assert "not ready: 2 problems" in out, out
    assert "data.preference.path: data/no-such.jsonl: no such file" in out
    assert "data.prompts.path: data/none-*.jsonl: the pattern matches no file" in out


def test_rlhf_check_turns_a_part_that_raises_into_a_problem(capsys, monkeypatch):
    """Whatever a part of the preflight meets that it did not foresee is a named problem, not a traceback."""
    from rlhf_pipeline import check

    def broken(*_):
        raise RuntimeError("the estimator met something new")

    monkeypatch.setattr(check, "_empty_model_builder", broken)
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "model: could not be checked: RuntimeError: the estimator met something new" in out, out


def test_rlhf_check_says_each_parameter_mistake_on_its_line(capsys):
    assert main(["check", "--set", "dpo.betaa=0.2"]) == 2
    out = capsys.readouterr().out
    assert "dpo.betaa: unknown field of dpo (did you mean `dpo.beta`?)" in out and "Traceback" not in out, out


def test_rlhf_run_help_names_every_algorithm_and_preset(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert all(algorithm in out for algorithm in ALGORITHMS), out
    assert "tiny (default)" in out and "smollm2" in out and "rlhf params --explain" in out


def test_rlhf_params_explain_shows_a_fields_help_type_default_and_value(capsys):
    assert main(["params", "--set", "dpo.beta=0.3", "--explain", "dpo.beta"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dpo.beta: KL strength"), out
    assert "type:    float" in out and "default: 0.1" in out and "value:   0.3" in out
    assert main(["params", "--explain", "algorithm"]) == 0
    assert "'dpo' | 'kto'" in capsys.readouterr().out
    assert main(["params", "--explain", "dpo"]) == 0
    assert "fields:  " in capsys.readouterr().out
    assert "did you mean `dpo.beta`?" in refused(capsys, ["params", "--explain", "dpo.bta"])


@pytest.mark.slow  # a run of the CI preset, with a CPU burner beside it
def test_refused_commands_start_nothing_and_a_valid_one_after_them_runs_on_a_fresh_home(tmp_path):
    """A newcomer's first command with a typo, then one naming a missing file, then the corrected one, on a fresh
    Prefect home with the machine loaded: the refused ones start no temporary server and make no Prefect database
    and no MLflow store (before, their server lived on and two of them raced on the database's migration)."""
    from tests.helpers import CI_PRESET

    home = tmp_path / "prefect"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_", "RLHF_"))}
    env |= {
        "PREFECT_HOME": str(home),
        "RLHF_STATE_DIR": str(tmp_path / "state"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "HF_HUB_OFFLINE": "1",
    }

    def rlhf(*argv: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rlhf_pipeline", "run", "--config", CI_PRESET, *argv]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for argv, says in (
            (["--set", "dpo.betaa=0.2"], "did you mean `dpo.beta`?"),
            (["--set", "data.preference.path=data/no-such-prefs.jsonl"], "no such file"),
        ):
            done = rlhf(*argv)
            assert done.returncode == 2 and says in done.stderr, done.stderr[-2000:]
            assert "Traceback" not in done.stderr and "duplicate column" not in done.stderr, done.stderr[-2000:]
            made = [p.name for p in home.rglob("*.db")] + [p.name for p in tmp_path.glob("*.db")]
            assert made == [], made  # no Prefect database, no MLflow store
        done = rlhf()
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "duplicate column" not in done.stdout + done.stderr
        assert (tmp_path / "mlflow.db").exists()
    finally:
        burner.kill()
        burner.wait()
