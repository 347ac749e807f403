"""What re-runs when the world changes: fresh data in a glob, an edit to one module's source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flows.helpers import run, task_states

pytestmark = pytest.mark.slow
NO_REGISTRY = "registry.enabled=false"  # the champion is an input of eval: keep it out (see test_registry)


def digest(summary: dict, stage: str) -> str:
    return json.loads((Path(summary["artifacts"][stage]) / "manifest.json").read_text())["digest"]


def test_a_new_file_in_the_preference_glob_re_runs_what_reads_preferences_and_not_sft(prefect, state, tmp_path):
    rows = Path("data/sort/preference.jsonl").read_text().splitlines(keepends=True)
    prefs = tmp_path / "prefs"
    prefs.mkdir()
    (prefs / "2026-11-23.jsonl").write_text("".join(rows[:1000]))
    (prefs / "2026-11-30.jsonl").write_text("".join(rows[1000:2000]))
    glob = f"data.preference.path={prefs}/*.jsonl"

    first = run(NO_REGISTRY, glob)
    assert task_states(first) == {
        "data": "Completed",
        "sft": "Completed",
        "rm": "Completed",
        "dpo": "Completed",
        "eval": "Completed",
    }
    assert task_states(run(NO_REGISTRY, glob)) == dict.fromkeys(["data", "sft", "rm", "dpo", "eval"], "Cached")

    (prefs / "2026-12-07.jsonl").write_text("".join(rows[2000:]))  # this week's labels arrive
    fresh = run(NO_REGISTRY, glob)
    assert task_states(fresh) == {
        "data": "Completed",
        "sft": "Cached",
        "rm": "Completed",
        "dpo": "Completed",
        "eval": "Completed",
    }
    assert (
        fresh.result()["metrics"]["eval/heldout/num_prompts"] == first.result()["metrics"]["eval/heldout/num_prompts"]
    )
    assert digest(fresh.result(), "sft") == digest(first.result(), "sft")
    assert digest(fresh.result(), "data") != digest(first.result(), "data")


def test_editing_a_module_re_runs_the_stages_that_import_it(prefect, state, monkeypatch):
    from rlhf_pipeline.tasks.store import code_version as code_version_module

    first = run(NO_REGISTRY)
    assert set(task_states(first).values()) == {"Completed"}
    original = code_version_module.read_source

    def edit(suffix: str) -> None:
        monkeypatch.setattr(
            code_version_module,
            "read_source",
            lambda file: original(file) + (b"\n# edited\n" if file.as_posix().endswith(suffix) else b""),
        )

    edit("trainers/evaluation/stage.py")
    assert task_states(run(NO_REGISTRY)) == {
        "data": "Cached",
        "sft": "Cached",
        "rm": "Cached",
        "dpo": "Cached",
        "eval": "Completed",
    }

    edit("trainers/models/tiny.py")  # the tiny tokenizer and model: read by data, sft and eval (the base model)
    retokenized = run(NO_REGISTRY)
    states = task_states(retokenized)
    assert (states["data"], states["sft"], states["eval"]) == ("Completed", "Completed", "Completed")
    # rm and dpo read only the SFT model's bytes: a byte-identical SFT model (deterministic CPU
    # training) leaves them cached, a different one re-keys them.
    same_sft = digest(retokenized.result(), "sft") == digest(first.result(), "sft")
    expected = "Cached" if same_sft else "Completed"
    assert (states["rm"], states["dpo"]) == (expected, expected)


def test_editing_a_file_in_a_local_model_folder_re_runs_the_stages_that_read_the_model(prefect, state, tmp_path):
    """A local model is keyed by its files, not its path: new weights under the same name are another model."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.foreign_models import qwen2_folder

    folder = qwen2_folder(tmp_path / "qwen2")
    settings = (NO_REGISTRY, f"model.name_or_path={folder}", "eval.max_prompts=4")
    first = run(*settings)
    assert first.is_completed(), first.message
    assert set(task_states(run(*settings)).values()) == {"Cached"}

    weights = load_file(str(folder / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 0.01 * torch.ones_like(weights[name])
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    edited = run(*settings)
    states = task_states(edited)
    assert states["sft"] == "Completed" and states["eval"] == "Completed", states
    assert digest(edited.result(), "sft") != digest(first.result(), "sft")
