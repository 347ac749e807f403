"""The whole pipeline on what users bring: model folders of other architectures (built here, with tokenizers
trained by `tokenizers`) and a chat dataset in TRL's conversational shapes without any reference answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.tasks.gate import RegistryConfig, unmeasured
from rlhf_pipeline.trainers.evaluation.stage import planned_metrics
from tests.flows.helpers import CI_PRESET, run, task_states
from tests.foreign_models import chat_data, gpt2_folder, qwen2_folder

pytestmark = pytest.mark.slow

LENGTHS = [f"{stage}.max_length=128" for stage in ("sft", "rm", "dpo", "grpo")] + [
    "grpo.max_completion_length=12",
    "eval.max_new_tokens=12",
]
REWARD_MODEL_ONLY = ["rewards.reward_model_weight=1", "rewards.functions=[]"]  # no reference: no verifier


def manifest(summary: dict, stage: str) -> dict:
    return json.loads((Path(summary["artifacts"][stage]) / "manifest.json").read_text())


@pytest.mark.parametrize("architecture", ["gpt2", "qwen2"])
def test_chat_data_without_references_on_a_foreign_model(prefect, state, tmp_path, architecture):
    folder = (gpt2_folder if architecture == "gpt2" else qwen2_folder)(tmp_path / architecture)
    settings = [
        *chat_data(tmp_path / "data"),
        *LENGTHS,
        *REWARD_MODEL_ONLY,
        f"model.name_or_path={folder}",
        f"registry.model_name=byo-{architecture}",
    ]

    if architecture == "gpt2":  # no chat template: stopped in data, with the rule and the fix
        refused = run(*settings)
        assert refused.is_failed()
        assert "rule 'chat_template'" in refused.message and "model.chat_template=chatml" in refused.message
        states = task_states(refused)
        assert states["data"] == "Failed" and not any(state == "Completed" for state in states.values()), states
        settings.append("model.chat_template=chatml")

    offline = run(*settings)
    assert offline.is_completed(), offline.message
    summary = offline.result()
    metrics = {k: v for k, v in summary["metrics"].items() if k.startswith(("eval/heldout/", "eval/sft_split/"))}
    # Everything that needs no reference, and nothing that does.
    params = load_params(CI_PRESET, settings)
    assert set(metrics) == planned_metrics(params.eval, has_reference=False, reward_model=True, champion=False)
    assert not any("exact_match" in name for name in metrics)
    assert (
        metrics["eval/heldout/win_rate_vs_sft_low"]
        <= metrics["eval/heldout/win_rate_vs_sft"]
        <= metrics["eval/heldout/win_rate_vs_sft_high"]
    )
    for name in ("kl_to_sft", "length_drift", "policy_mean_length"):
        assert f"eval/heldout/{name}" in metrics
    assert summary["registry"]["promoted"] and "no champion yet" in summary["registry"]["reason"]
    # tests/ci.yaml turns the start check off; with it on (the default) this first version stays a candidate, for
    # nothing measured it against its start (no gold metric, no reference answers)
    assert "nothing measured this policy against its start" in (unmeasured(RegistryConfig(), summary["metrics"]) or "")

    # One tokenizer through the run: the same files (and chat template) in every stage's model.
    digests = {stage: manifest(summary, stage)["tokenizer"] for stage in ("sft", "rm", "dpo")}
    assert len(set(digests.values())) == 1 and "" not in digests.values(), digests
    tokenizer = AutoTokenizer.from_pretrained(Path(summary["artifacts"]["dpo"]) / "model")
    assert "<|im_start|>" in tokenizer.chat_template

    online = run(*settings, "algorithm=grpo")
    assert online.is_completed(), online.message
    # data re-checks (grpo's token limits differ from dpo's) but freezes the same datasets: sft and rm are reused.
    assert {name: state for name, state in task_states(online).items() if name in ("sft", "rm")} == dict.fromkeys(
        ("sft", "rm"), "Cached"
    )
    second = online.result()
    assert "eval/heldout/win_rate_vs_champion" in second["metrics"]
    assert (
        second["registry"]["reason"].startswith("eval/heldout/win_rate_vs_champion")
        or "win_rate_vs_champion" in second["registry"]["reason"]
    )
    # Generation stops at the template's end of turn as well as at EOS (TRL's GRPO reads it from here).
    stops = json.loads((Path(second["artifacts"]["grpo"]) / "model" / "generation_config.json").read_text())[
        "eos_token_id"
    ]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in (stops if isinstance(stops, list) else [stops])
