"""`rlhf check`: the preflight a user runs on a preset before renting a GPU, in-process on the fixtures of what users
bring."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from rlhf_pipeline.cli import main
from tests.foreign_models import chat_data, gpt2_folder, qwen2_folder

UNITS = {"bytes": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return qwen2_folder(tmp_path_factory.mktemp("qwen") / "model")


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("chat")
    return folder, chat_data(folder)


def check(capsys, *overrides: str, config: str = "qwen2.5-0.5b") -> tuple[int, str]:
    code = main(["check", "--config", config, *(arg for item in overrides for arg in ("--set", item))])
    return code, capsys.readouterr().out


def table(out: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the ' | ' table whose header starts with `first_header`, as dicts."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header + " ") and " | " in line)
    headers = [cell.strip() for cell in lines[start].split(" | ")]
    rows = []
    for line in lines[start + 1 :]:
        if " | " not in line:
            break
        rows.append(dict(zip(headers, (cell.strip() for cell in line.split(" | ")))))
    return rows


def memory(out: str) -> dict[str, dict[str, str]]:
    return {row["stage"]: row for row in table(out, "stage")}


def in_bytes(size: str) -> float:
    number, unit = size.split()
    return float(number) * UNITS[unit]


def test_the_qwen_preset_on_a_qwen2_folder_is_ready_offline_with_token_percentiles_and_memory_per_stage(
    capsys, qwen, chat
):
    folder, data = chat
    code, out = check(capsys, f"model.name_or_path={qwen}", *data)
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("ready:")

    # The sft rows counted independently: ChatML rendered to text, then tokenized (the template adds no BOS).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen)
    rows = [json.loads(line) for line in (folder / "sft.jsonl").read_text().splitlines()]
    counts = [
        len(
            tokenizer(tokenizer.apply_chat_template(row["messages"], tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        )
        for row in rows
    ]
    assert np.median(counts) < max(counts)  # the fixture's own system turn on half the rows: p50 is not the max
    lengths = {(row["dataset"], row["stage"]): row for row in table(out, "dataset")}
    sft = lengths["sft", "sft"]
    expected = {f"p{q}": int(np.percentile(counts, q, method="inverted_cdf")) for q in (50, 90, 99)}
    assert {key: int(sft[key]) for key in expected} == expected
    assert (int(sft["rows"]), int(sft["max"]), sft["limit"], sft["over"]) == (len(rows), max(counts), "1024", "0")
    # Every dataset, under each stage of the plan that reads it, against that stage's limit.
    assert set(lengths) >= {
        ("preference", "rm"),
        ("preference", "dpo"),
        ("preference_eval", "rm"),
        ("prompts_eval", "eval"),
    }
    assert lengths["prompts", "-"]["limit"] == "-"  # prompts is read by no stage of a dpo run

    stages = memory(out)
    assert list(stages) == ["data", "sft", "rm", "dpo", "eval", "registry"]
    assert stages["data"]["holds"] == stages["registry"]["holds"] == "no model"
    assert stages["dpo"]["holds"] == "policy (trained) + reference"
    # Qwen2-style tied embeddings: the LM head is the embedding, counted once. On the CPU (no bf16),
    # float32 weights + float32 gradients + two AdamW states: 16 bytes per trained parameter.
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(qwen).parameters())
    assert in_bytes(stages["sft"]["weights"]) == pytest.approx(4 * params, rel=0.01)
    assert in_bytes(stages["sft"]["total"]) == pytest.approx(16 * params, rel=0.01)
    assert in_bytes(stages["dpo"]["total"]) == pytest.approx(20 * params, rel=0.01)  # plus the frozen reference
    assert in_bytes(stages["eval"]["total"]) == pytest.approx(8 * params, rel=0.01)  # policy and sft, nothing trained
    assert "activations, KV cache and batches NOT included" in out


def test_a_preference_row_whose_chosen_equals_rejected_fails_naming_the_rule_and_the_row(capsys, qwen, chat, tmp_path):
    folder, data = chat
    rows = [json.loads(line) for line in (folder / "preference.jsonl").read_text().splitlines()]
    rows[3]["rejected"] = rows[3]["chosen"]
    broken = tmp_path / "preference.jsonl"
    broken.write_text("".join(json.dumps(row) + "\n" for row in rows))

    code, out = check(capsys, f"model.name_or_path={qwen}", *data, f"data.preference.path={broken}")
    assert code == 1
    assert f"{broken}: rule 'chosen_differs_from_rejected' failed for 1 of {len(rows)} rows" in out
    assert "row 3 (0-based)" in out
    assert "not ready: 1 problem" in out and "1 data check failed" in out
    # Its lengths are still shown: a failing dataset's lengths often say why it fails.
    assert any(row["dataset"] == "preference" and row["rows"] == str(len(rows)) for row in table(out, "dataset"))


def test_a_gpt2_folder_without_a_chat_template_fails_rule_chat_template_until_one_is_named(capsys, chat, tmp_path):
    gpt2 = gpt2_folder(tmp_path / "gpt2")
    _, data = chat
    code, out = check(capsys, f"model.name_or_path={gpt2}", *data)
    assert code == 1
    assert out.count("rule 'chat_template' failed") == 5  # every dataset is conversational
    assert "model.chat_template=chatml" in out

    code, out = check(capsys, f"model.name_or_path={gpt2}", "model.chat_template=chatml", *data)
    assert code == 0, out
    assert "chat template chatml" in out


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("sft.learning_rate=-1", "greater than 0"),
        ("sft.no_such_field=1", "unknown field of sft"),
        ("sft.max_steps", "expected key.path=value"),
    ],
)
def test_invalid_parameters_exit_2_with_the_error(capsys, override, says):
    code, out = check(capsys, override, config="tiny")
    assert code == 2
    assert "invalid parameters" in out and says in out
    assert "token lengths" not in out  # nothing else is checked on parameters the run would refuse


def test_hub_ids_offline_fail_on_the_tokenizer_and_every_dataset(capsys):
    code, out = check(capsys)  # the preset as shipped: Qwen/Qwen2.5-0.5B and TRL's datasets, none cached here
    assert code == 1
    assert "tokenizer: cannot be loaded from 'Qwen/Qwen2.5-0.5B'" in out
    assert out.count("could not be read as a dataset") == 5
    assert "model config: cannot be loaded" in out


def test_the_memory_estimate_grows_with_the_model_and_drops_with_lora_for_sft_only(capsys):
    code, base = check(capsys, config="tiny")
    assert code == 0, base
    # The run's plan, step by step, as `rlhf params --plan` prints it.
    assert "  dpo          <- data, sft  (after rm)\n" in base and "  registry     <- policy=dpo, report=eval" in base
    _, wider = check(capsys, "model.tiny.hidden_size=256", config="tiny")
    _, lora = check(capsys, "sft.lora.enabled=true", config="tiny")
    base, wider, lora = memory(base), memory(wider), memory(lora)

    for stage in ("sft", "rm", "dpo", "eval"):
        assert in_bytes(wider[stage]["total"]) > 2 * in_bytes(base[stage]["total"]), stage
    assert lora["sft"]["holds"] == "policy (LoRA)"
    # Adapters are ~1/6 of the tiny model
    assert in_bytes(lora["sft"]["grads+AdamW"]) < in_bytes(base["sft"]["grads+AdamW"]) / 3
    assert in_bytes(lora["sft"]["weights"]) > in_bytes(base["sft"]["weights"])  # the adapters are weights too
    assert in_bytes(lora["sft"]["total"]) < in_bytes(base["sft"]["total"])
    # Control
    assert {stage: lora[stage] for stage in ("rm", "dpo", "eval")} == {
        stage: base[stage] for stage in ("rm", "dpo", "eval")
    }


def test_on_cuda_a_stage_over_the_free_memory_is_flagged_and_fails(capsys, monkeypatch):
    import accelerate.utils

    free = 10 * 1024**2  # between the tiny eval (two models, nothing trained) and its sft
    monkeypatch.setattr(accelerate.utils, "is_cuda_available", lambda: True)
    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda: {0: free, "cpu": 1 << 40})
    code, out = check(capsys, config="tiny")
    stages = memory(out)
    assert code == 1
    assert (stages["sft"]["fits"], stages["eval"]["fits"]) == ("NO", "yes")
    assert in_bytes(stages["eval"]["total"]) < free < in_bytes(stages["sft"]["total"])
    assert re.search(r"not ready: .*sft needs more than .* of 10\.0 MB free on cuda:0", out)
