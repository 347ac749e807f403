"""Bad configuration exits 2 with the file (or the `--set` item) and the problem, before anything runs: never a
traceback, never a model trained on it."""

from __future__ import annotations

import pytest

from rlhf_pipeline.cli import main
from rlhf_pipeline.tasks.tracking import client as tracking

PRESETS = {
    "unclosed.yaml": ("sft: {max_steps: 3\n", "line 2 column 1: not valid YAML"),
    "tagged.yaml": ("sft: !!python/object/apply:os.system [touch pwned]\n", "line 1 column 6: not valid YAML"),
    "listed.yaml": ("- sft\n- dpo\n", "a preset is a mapping of blocks and fields, not a list"),
    "parent.yaml": ("extends: 3\n", "extends names one preset, got 3"),
}


def refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_that_is_not_a_mapping_of_plain_yaml_is_named_with_its_line(name, tmp_path, capsys):
    text, problem = PRESETS[name]
    (tmp_path / name).write_text(text)
    assert problem in refused(capsys, ["params", "--config", str(tmp_path / name)])
    assert not (tmp_path / "pwned").exists()


def test_presets_that_extend_each_other_are_a_cycle_named_in_order(tmp_path, capsys):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(f"extends: {second}\n")
    second.write_text(f"extends: {first}\n")
    assert f"{first} extends {second} extends {first}, a cycle" in refused(capsys, ["params", "--config", str(first)])


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("sft.learning_rate=.inf", "input should be a finite number"),
        ("dpo.beta=.nan", "input should be a finite number"),
        ("sft.max_steps=100000000000000000000000", "max_steps=1e+23 is over 1,000,000,000 steps"),
        ("sft.learning_rate=30", "learning_rate=30 is over 10"),
        ("dpo.max_length=1e12", "max_length"),
        ("eval.max_new_tokens=99999999999", "max_new_tokens=1e+11 is over 1,048,576 tokens"),
        ("experiment_name=" + "x" * 300, "experiment_name is 300 characters: at most 200 bytes"),
        ("experiment_name=", "experiment_name is empty"),
        ("registry.model_name=team/policy", "MLflow names may not hold '/' or ':'"),
        ("dpo.beta=!!python/name:os.system", "line 1 column 1: not valid YAML"),
    ],
)
def test_numbers_that_are_not_finite_or_past_sane_bounds_and_names_mlflow_cannot_hold_are_refused(given, says, capsys):
    assert says in refused(capsys, ["params", "--set", given])


def test_rlhf_export_refuses_a_link_a_dangling_link_and_a_version_that_does_not_exist(tmp_path, state, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "linked").symlink_to(empty)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out in ("linked", "dangling"):
        err = refused(capsys, ["export", str(folder), str(tmp_path / out)])
        assert f"{tmp_path / out} is a link" in err, err
    assert not (tmp_path / "nowhere").exists() and not any(empty.iterdir())  # nothing written through the links
    tracking.client().create_registered_model("exported-policy")
    err = refused(capsys, ["export", "models:/exported-policy/3", str(tmp_path / "out")])
    assert "registered model 'exported-policy' has no version 3" in err, err
