"""What a run may make the worker execute is the operator's setting: an import path or `trust_remote_code` the worker
does not allow is refused with the parameters, before the module is imported, from the CLI and from a flow run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlhf_pipeline.cli import main
from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.trainers.runtime.trust import IMPORTS_ENV, REMOTE_CODE_ENV


@pytest.fixture
def planted(tmp_path, monkeypatch) -> Path:
    """A module `planted_lab.rewards` on the path that leaves a file behind when it is imported: code that ran."""
    (tmp_path / "planted_lab").mkdir()
    (tmp_path / "planted_lab" / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    (tmp_path / "planted_lab" / "rewards.py").write_text(
        "def score(prompts, completions, **kwargs):\n    return [0.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(IMPORTS_ENV, raising=False)  # the suite itself allows every module (tests/conftest.py)
    yield tmp_path / "ran"
    for name in [name for name in sys.modules if name.startswith("planted_lab")]:
        del sys.modules[name]


REWARD = "rewards.functions=[{path: planted_lab.rewards:score}]"


def test_an_import_path_the_operator_did_not_allow_is_refused_before_it_is_imported(planted, monkeypatch, capsys):
    for where in (REWARD, "sft.callbacks=[{path: planted_lab.rewards:score}]", "dpo.compute_metrics=planted_lab:x"):
        with pytest.raises(ValidationError, match=f"importing 'planted_lab(.rewards)?' is not allowed.*{IMPORTS_ENV}"):
            load_params("tiny", ["algorithm=grpo", where])
    assert main(["params", "--set", "algorithm=grpo", "--set", REWARD]) == 2  # `rlhf params` imports nothing either
    assert IMPORTS_ENV in capsys.readouterr().err
    assert not planted.exists(), "the module ran"
    # The pipeline's own modules are always allowed.
    load_params(
        "tiny", ["algorithm=grpo", "rewards.functions=[{path: rlhf_pipeline.trainers.rewards.sort_task:exact_match}]"]
    )

    for allowed in ("planted_lab", "other,planted_lab.rewards", "planted_lab.rewards:score", "*"):
        monkeypatch.setenv(IMPORTS_ENV, allowed)
        assert load_params("tiny", ["algorithm=grpo", REWARD]).rewards.functions[0].path == "planted_lab.rewards:score"
    for refused in ("planted", "planted_lab.other", "planted_lab.rewards:other"):  # prefixes are whole names
        monkeypatch.setenv(IMPORTS_ENV, refused)
        with pytest.raises(ValidationError, match=f"now: {refused}"):
            load_params("tiny", ["algorithm=grpo", REWARD])


def test_trust_remote_code_is_refused_unless_the_operator_allows_the_repository(monkeypatch):
    monkeypatch.delenv(REMOTE_CODE_ENV, raising=False)
    for given in (["model.name_or_path=org/custom-arch"], ["eval.judge={path: org/judge-lm}"]):
        block = given[0].split(".")[0]
        field = f"{block}.trust_remote_code=true" if block == "model" else "eval.judge={path: org/judge-lm, "
        overrides = [*given, field] if block == "model" else [field + "trust_remote_code: true}"]
        with pytest.raises(ValidationError, match=f"trust_remote_code=true for 'org/.*'.*{REMOTE_CODE_ENV}.*now: none"):
            load_params("tiny", overrides)
    monkeypatch.setenv(REMOTE_CODE_ENV, "org/custom-*")
    assert load_params("tiny", ["model.name_or_path=org/custom-arch", "model.trust_remote_code=true"])
    with pytest.raises(ValidationError, match="now: org/custom-"):
        load_params("tiny", ["model.name_or_path=elsewhere/custom-arch", "model.trust_remote_code=true"])


def test_a_flow_run_with_remote_code_fails_with_the_parameters_and_runs_no_stage(prefect, state, monkeypatch):
    from rlhf_pipeline.flows.rlhf import rlhf

    monkeypatch.delenv(REMOTE_CODE_ENV, raising=False)
    outcome = rlhf(model={"name_or_path": "org/custom-arch", "trust_remote_code": True}, return_state=True)
    assert outcome.is_failed()
    assert REMOTE_CODE_ENV in str(outcome.message) or REMOTE_CODE_ENV in repr(outcome.result(raise_on_failure=False))
    assert not (state / "artifacts").exists(), "a stage ran"


def test_no_experiment_name_reaches_outside_the_artifact_folder(state):
    from mlflow.tracking import MlflowClient

    from rlhf_pipeline.tasks.tracking import client as tracking

    for name in ("../../escaped", "/abs/olute", ".."):
        location = MlflowClient().get_experiment(tracking.experiment_id(name)).artifact_location
        folder = Path(location.removeprefix("file://"))
        assert folder.parent == tracking.state_dir() / "mlartifacts", (name, location)
