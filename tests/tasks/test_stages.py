"""The table of stages and what is derived from it: trainer contracts, code versions, the algorithm choices."""

from __future__ import annotations

import inspect

import pytest

from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.flows.plan import stages, upstream
from rlhf_pipeline.tasks.stages import BY_NAME, STAGES
from rlhf_pipeline.tasks.store.code_version import code_version, project_imports
from rlhf_pipeline.tasks.training import MODEL_INPUTS, trainer_parameters

TINY = "rlhf_pipeline.trainers.models.tiny"
EVAL = "rlhf_pipeline.trainers.evaluation.stage"


def closure(stage: str) -> set[str]:
    return set(project_imports(BY_NAME[stage].code.__name__))


@pytest.mark.parametrize("stage", [s.name for s in STAGES if s.builds_with == "train"])
def test_every_trainer_takes_what_its_row_says(stage):
    parameters = trainer_parameters(BY_NAME[stage])
    signature = inspect.signature(BY_NAME[stage].code.train).parameters
    takes = {
        MODEL_INPUTS[p] for p in parameters if p in MODEL_INPUTS and signature[p].default is inspect.Parameter.empty
    }
    assert takes <= set(BY_NAME[stage].upstream), f"{stage} takes {takes} but its row lists {BY_NAME[stage].upstream}"
    # No stage takes a model its row does not list (a feedback round's policy arrives as `sft`).
    extra = {MODEL_INPUTS[p] for p in parameters if p in MODEL_INPUTS} - takes - set(BY_NAME[stage].upstream)
    assert extra == set(), (stage, extra)
    assert {"cfg", "data_dir", "out_dir", "work_dir"} <= set(parameters)


def test_code_versions_follow_the_imports_not_a_list():
    # The tiny tokenizer and model are read by the stages that start from the base model only.
    assert {stage for stage in BY_NAME if BY_NAME[stage].code and TINY in closure(stage)} == {"data", "sft", "eval"}
    # Editing the evaluation code re-keys eval alone (PPO and the rewards render text through trainers.models.text).
    assert {stage for stage in BY_NAME if BY_NAME[stage].code and EVAL in closure(stage)} == {"eval"}
    assert "rlhf_pipeline.trainers.models.text" in closure("ppo")
    assert "rlhf_pipeline.trainers.rewards.mix" in closure("grpo")
    # Imports inside functions count: the data stage's validators are imported lazily.
    assert "rlhf_pipeline.validators.rules" in closure("data")


def test_imports_inside_functions_count_and_imports_for_annotations_do_not(tmp_path):
    from rlhf_pipeline.tasks.store.code_version import _imported_modules

    module = tmp_path / "trainer.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlhf_pipeline.trainers.models.tiny import build_model\n"
        "def train():\n    from rlhf_pipeline.trainers.models import text\n"
        "    import rlhf_pipeline.trainers.rewards.metrics\n"
    )
    assert set(_imported_modules(module, "trainer")) == {
        "rlhf_pipeline",
        "rlhf_pipeline.trainers",
        "rlhf_pipeline.trainers.models",
        "rlhf_pipeline.trainers.models.text",
        "rlhf_pipeline.trainers.rewards",
        "rlhf_pipeline.trainers.rewards.metrics",
    }


def test_a_source_edit_changes_exactly_the_versions_of_the_stages_that_import_it(monkeypatch):
    from rlhf_pipeline.tasks.store import code_version as code_version_module

    before = {s.name: code_version(s.code and s.code.__name__) for s in STAGES}
    edited = BY_NAME["eval"].code.__name__.replace(".", "/").removeprefix("rlhf_pipeline/")
    original = code_version_module.read_source
    monkeypatch.setattr(
        code_version_module,
        "read_source",
        lambda file: original(file) + (b"# edit" if file.as_posix().endswith(edited + ".py") else b""),
    )
    after = {s.name: code_version(s.code and s.code.__name__) for s in STAGES}
    assert {name for name in before if before[name] != after[name]} == {"eval"}


def test_a_docstring_or_comment_edit_in_trainers_config_re_keys_no_stage_and_a_code_edit_re_keys_them_all(monkeypatch):
    from pathlib import Path

    from rlhf_pipeline.tasks.store import code_version as code_version_module
    from rlhf_pipeline.tasks.store.code_version import code_of

    config = Path(BY_NAME["sft"].code.__file__).parents[1] / "config.py"
    text = config.read_text()
    read = Path.read_text

    def versions(edited: str) -> dict[str, str]:
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: edited if self == config else read(self, *a, **k))
        # The edit is read, not written: the file's time and size, which key the process's parsed code, stay as they are
        code_version_module._code_of_file.cache_clear()
        return {s.name: code_version(s.code and s.code.__name__) for s in STAGES}

    before = versions(text)
    docstring = '"""What every stage\'s config answers'
    assert docstring in text
    prose = text.replace(docstring, '"""What each stage\'s config answers (reworded)').replace(
        "\n\n\n", "\n\n\n# a comment\n", 1
    )
    assert code_of(prose) == code_of(text) and versions(prose) == before
    code = text.replace(
        "def held_out(self) -> tuple[str, ...]:", "def held_out(self) -> tuple[str, ...]:\n        pass"
    )
    assert code != text
    after = versions(code)
    assert {name for name in before if before[name] != after[name]} == {s.name for s in STAGES} - {"registry"}


def test_editing_the_console_re_keys_no_stage(monkeypatch):
    """The bars are drawn by the CLI's console from the trainers' progress records: a cosmetic edit retrains nothing."""
    from rlhf_pipeline.tasks.store import code_version as code_version_module
    from rlhf_pipeline.tasks.store.code_version import project_imports

    before = {s.name: code_version(s.code and s.code.__name__) for s in STAGES}
    original = code_version_module.read_source

    def edit(suffix: str) -> None:
        edited = lambda file: original(file) + (b"\nREFRESH = 1.0\n" if file.as_posix().endswith(suffix) else b"")
        monkeypatch.setattr(code_version_module, "read_source", edited)

    edit("rlhf_pipeline/console.py")
    assert {s.name: code_version(s.code and s.code.__name__) for s in STAGES} == before
    # The control: the console is code the CLI runs, and an edit of what the trainers emit re-keys every stage that
    # trains or evaluates, and data, which loads the base model's tokenizer (converting a GGUF file, with progress
    # lines).
    assert "rlhf_pipeline.console" in project_imports("rlhf_pipeline.cli")
    edit("trainers/runtime/progress.py")
    after = {s.name: code_version(s.code and s.code.__name__) for s in STAGES}
    assert {name for name in before if before[name] != after[name]} == {s.name for s in STAGES} - {"registry"}


def test_the_algorithm_choices_and_the_plan_come_from_the_table():
    with pytest.raises(ValueError, match="algorithm"):
        load_params("tiny", ["algorithm=ppo2"])
    assert stages(load_params("tiny", ["algorithm=kto", "eval.use_reward_model=false"])) == [
        "data",
        "sft",
        "kto",
        "eval",
        "registry",
    ]
    params = load_params("tiny", ["algorithm=grpo", "rewards.reward_model_weight=0", "eval.use_reward_model=false"])
    assert stages(params) == ["data", "sft", "grpo", "eval", "registry"]
    assert upstream(params, "eval") == ("data", "sft", "grpo")
    with_rm = load_params("tiny", ["algorithm=ppo", "rewards.reward_model_weight=1"])
    assert stages(with_rm) == ["data", "sft", "rm", "ppo", "eval", "registry"] and upstream(with_rm, "ppo") == (
        "data",
        "sft",
        "rm",
    )
