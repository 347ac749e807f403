"""What run names show of a preset and of the model an `rlhf-eval` run evaluates (tasks/orchestration/parent_run.py)."""

from rlhf_pipeline.tasks.orchestration.parent_run import model_label, preset_label


def test_run_names_show_the_preset_by_its_name_and_the_evaluated_model_by_what_a_person_knows_it_by():
    assert [preset_label(p) for p in ("tiny", "tests/ci.yaml", "/abs/presets/smollm2.yaml", None)] == [
        "tiny",
        "ci",
        "smollm2",
        "defaults",
    ]
    assert model_label("models:/rlhf-policy@candidate") == "rlhf-policy@candidate"
    assert model_label("models:/rlhf-policy/3") == "rlhf-policy/3"
    assert model_label("state/artifacts/dpo/4f2a9c/model") == "4f2a9c"  # a stage's model folder: its artifact's key
    assert model_label("/models/my-policy/") == "my-policy"
