"""Model cards on a real run, and `rlhf export` of the champion in Hub layout (issue 28, item 2)."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from rlhf_pipeline.cli import main
from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.tasks.stages import reads
from tests.flows.helpers import run
from tests.helpers import CI_PRESET

pytestmark = pytest.mark.slow  # two pipeline runs end to end (the second trains grpo alone)

MODEL_NAME = "cards-policy"


def test_every_published_model_has_a_card_and_the_champion_exports_in_hub_layout(prefect, state, tmp_path):
    first = run("experiment_name=cards", f"registry.model_name={MODEL_NAME}")
    assert first.is_completed(), first.message
    # An online policy too (its card names the reward model it used); data, sft and rm are cached.
    second = run("experiment_name=cards", "algorithm=grpo", "registry.enabled=false")
    assert second.is_completed(), second.message

    data_dir = next((state / "artifacts" / "data").glob("*/manifest.json")).parent
    sources = {
        name: spec["path"]
        for name, spec in json.loads((data_dir / "manifest.json").read_text())["config"].items()
        if isinstance(spec, dict) and "path" in spec
    }
    folders = sorted(state.glob("artifacts/*/*/model"))
    assert sorted(folder.parent.parent.name for folder in folders) == ["dpo", "grpo", "rm", "sft"]
    cards = {}
    for folder in folders:
        stage = folder.parent.parent.name
        card = cards[stage] = ModelCard.load(folder / "README.md")
        assert card.data.base_model == "tiny", stage  # the run's base model, also for the stages after sft
        assert card.data.datasets, stage
        assert stage in card.data.tags and card.data.library_name == "transformers"
        manifest = json.loads((folder.parent / "manifest.json").read_text())
        assert "model/README.md" in manifest["files"]  # the manifest vouches for the card: it is in the digest
        assert card.data.rlhf_pipeline["key"] == manifest["key"]
        assert all(row["digest"] for row in card.data.rlhf_pipeline["datasets"].values())
    params = load_params(CI_PRESET)
    for stage in ("sft", "rm", "dpo", "grpo"):  # the datasets each stage reads (held-out ones included), no others
        assert cards[stage].data.datasets == sorted(sources[name] for name in reads(stage, getattr(params, stage)))
    assert cards["dpo"].data.datasets == [sources["preference"]]
    assert cards["rm"].data.pipeline_tag == "text-classification"
    sft_key = cards["sft"].data.rlhf_pipeline["key"]
    for stage in ("rm", "dpo", "grpo"):
        assert cards[stage].data.rlhf_pipeline["trained_from"]["sft"]["key"] == sft_key
    assert "| `rewards.reward_model_weight` | `0.0` |" in cards["grpo"].text  # the run's rewards block it trained with

    out = tmp_path / "hub" / "rlhf-policy"
    assert main(["export", f"models:/{MODEL_NAME}@champion", str(out)]) == 0
    names = {path.name for path in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= names
    assert not names & {"manifest.json", "history.jsonl", "training.json"}
    assert all(path.is_file() for path in out.iterdir())  # no checkpoints, no nested folders
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "tiny" and card.data.datasets == [sources["preference"]]
    assert card.data.model_name == f"{MODEL_NAME}-v1"
    eval_manifest = json.loads(next((state / "artifacts" / "eval").glob("*/manifest.json")).read_text())
    held_out = eval_manifest["metrics"]
    results = {result.metric_type: result for result in card.data.eval_results}
    for name in ("policy_exact_match", "win_rate_vs_sft"):
        result = results[name]
        assert result.metric_value == held_out[f"eval/heldout/{name}"]
        assert result.metric_args["ci_low"] == held_out[f"eval/heldout/{name}_low"]
        assert result.metric_args["ci_high"] == held_out[f"eval/heldout/{name}_high"]
        assert result.dataset_type == sources["prompts_eval"]
    assert "sft_exact_match" not in results  # another model's row: in the card's table, not the policy's results

    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)

    # A second export into the now non-empty folder is refused, and nothing is changed.
    before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    assert main(["export", f"models:/{MODEL_NAME}@champion", str(out)]) == 2
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == before
    assert [path.name for path in out.parent.iterdir()] == ["rlhf-policy"]
