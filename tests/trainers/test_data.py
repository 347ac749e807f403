"""Every dataset shape TRL documents loads, validates, survives the Parquet copy, and trains."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.trainers.algorithms import dpo, rm, sft
from rlhf_pipeline.trainers.data import DatasetSpec, dataset_fingerprint, load_source
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import load_causal_lm
from rlhf_pipeline.validators import detect_format, validate_dataset
from tests.helpers import FAST, SMALL_MODEL, trainable, unchanged, write_jsonl


def conversation(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


SHAPES = {
    ("sft", "standard LM"): [{"text": "sort 21 -> 12", "source": "x"}],
    ("sft", "conversational LM"): [{"messages": conversation("sort 21 -> ", "12"), "source": "x"}],
    ("sft", "standard prompt-completion"): [{"prompt": "sort 21 -> ", "completion": "12", "source": "x"}],
    ("sft", "conversational prompt-completion"): [
        {
            "prompt": [{"role": "user", "content": "sort 21 -> "}],
            "completion": [{"role": "assistant", "content": "12"}],
            "source": "x",
        }
    ],
    ("preference", "standard explicit"): [{"prompt": "sort 21 -> ", "chosen": "12", "rejected": "21", "source": "x"}],
    ("preference", "standard implicit"): [{"chosen": "sort 21 -> 12", "rejected": "sort 21 -> 21", "source": "x"}],
    ("preference", "conversational explicit"): [
        {
            "prompt": [{"role": "user", "content": "sort 21 -> "}],
            "chosen": [{"role": "assistant", "content": "12"}],
            "rejected": [{"role": "assistant", "content": "21"}],
            "source": "x",
        }
    ],
    ("preference", "conversational implicit"): [
        {"chosen": conversation("sort 21 -> ", "12"), "rejected": conversation("sort 21 -> ", "21"), "source": "x"}
    ],
    ("prompt", "standard"): [{"prompt": "sort 21 -> ", "answer": "12"}],
    ("prompt", "conversational"): [{"prompt": [{"role": "user", "content": "sort 21 -> "}], "answer": "12"}],
}


@pytest.mark.parametrize(("kind", "shape"), list(SHAPES), ids=[" ".join(k) for k in SHAPES])
def test_every_trl_shape_loads_from_jsonl_and_keeps_extra_columns(tmp_path, kind, shape):
    rows = SHAPES[(kind, shape)] * 8
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    dataset = load_source(DatasetSpec(path=str(path)))
    validate_dataset(kind, dataset, source=str(path))
    dataset.to_parquet(str(tmp_path / "d.parquet"))
    from datasets import Dataset

    copy = Dataset.from_parquet(str(tmp_path / "d.parquet"))
    assert copy[0] == rows[0]  # nested messages and extra columns survive the freeze
    fmt = detect_format(kind, copy, str(path))
    assert fmt.conversational == ("conversational" in shape)


def test_unpaired_preferences_get_a_clear_error(tmp_path):
    # Unpaired rows are KTO's preference format; with one label only, KTO has nothing to contrast.
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "a", "completion": "b", "label": True}] * 3)
    with pytest.raises(
        ValueError,
        match=(
            r"kto\.jsonl: rule 'both_labels_present' failed for 3 of 3 rows .* row 0 \(0-based\): all 3 labels are "
            r"True"
        ),
    ):
        validate_dataset("preference", load_source(DatasetSpec(path=str(path))), source=str(path))


def test_unreadable_and_missing_files_name_the_file(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "compl')
    with pytest.raises(ValueError, match="broken.jsonl"):
        load_source(DatasetSpec(path=str(broken)))
    with pytest.raises(ValueError, match="nope.jsonl: no such file"):
        load_source(DatasetSpec(path=str(tmp_path / "nope.jsonl")))


def test_fingerprint_follows_content_not_name(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "x"}])
    c = write_jsonl(tmp_path / "c.jsonl", [{"text": "y"}])
    fa, fb, fc = (dataset_fingerprint(DatasetSpec(path=str(p))) for p in (a, b, c))
    assert fa == fb != fc


def test_a_glob_reads_every_matching_file_and_a_new_file_changes_the_fingerprint(tmp_path):
    write_jsonl(tmp_path / "2026-11-01.jsonl", [{"text": "a"}, {"text": "b"}])
    write_jsonl(tmp_path / "2026-11-08.jsonl", [{"text": "c"}])
    spec = DatasetSpec(path=str(tmp_path / "2026-*.jsonl"))
    before = dataset_fingerprint(spec)
    assert sorted(load_source(spec)["text"]) == ["a", "b", "c"]
    assert dataset_fingerprint(spec) == before
    write_jsonl(tmp_path / "2026-11-15.jsonl", [{"text": "d"}])  # this week's data lands
    assert dataset_fingerprint(spec) != before
    assert len(load_source(spec)) == 4
    with pytest.raises(ValueError, match=r"2025-\*.jsonl: the pattern matches no file"):
        dataset_fingerprint(DatasetSpec(path=str(tmp_path / "2025-*.jsonl")))


def _frozen(tmp_path, name: str, kind: str, shape: str) -> None:
    (tmp_path / "datasets").mkdir(exist_ok=True)
    dataset = load_source(DatasetSpec(path=str(write_jsonl(tmp_path / f"{name}.jsonl", SHAPES[(kind, shape)] * 16))))
    dataset.to_parquet(str(tmp_path / "datasets" / f"{name}.parquet"))


def test_conversational_data_trains_through_sft_rm_and_dpo(tmp_path):
    _frozen(tmp_path, "sft", "sft", "conversational LM")
    _frozen(tmp_path, "preference", "preference", "conversational implicit")
    fast = {**FAST, "max_steps": 2}
    logged: dict[str, list[dict]] = {"sft": [], "rm": [], "dpo": []}

    def log(stage: str):
        def per_step(values: dict, step: int) -> None:
            if f"{stage}/train/loss" in values:  # not the closing summary
                logged[stage].append(values)

        return per_step

    # Each dataset is 16 copies of one row: one batch, so step 2 sees exactly what step 1 learnt from.
    sft.train(
        sft.SftConfig(assistant_only_loss=True, **fast),
        SMALL_MODEL,
        tmp_path,
        tmp_path / "sft",
        tmp_path / "w1",
        log("sft"),
    )
    assert logged["sft"][1]["sft/train/loss"] < logged["sft"][0]["sft/train/loss"]
    sft_model = load_causal_lm(tmp_path / "sft" / "model")[0]
    assert unchanged(trainable(load_base_model(SMALL_MODEL)[0]), sft_model) == []
    torch.manual_seed(0)  # the reward model's new head is drawn from torch's global RNG
    rm.train(
        rm.RewardModelConfig(**fast), tmp_path / "sft" / "model", tmp_path, tmp_path / "rm", tmp_path / "w2", log("rm")
    )
    margins = [values["rm/train/margin"] for values in logged["rm"]]
    # After one update, the pair is ranked right
    assert margins[1] > margins[0] and logged["rm"][1]["rm/train/accuracy"] == 1.0
    dpo.train(
        dpo.DpoConfig(**fast), tmp_path / "sft" / "model", tmp_path, tmp_path / "dpo", tmp_path / "w3", log("dpo")
    )
    # Step 1 scores the policy while it still is the reference (margin 0); at step 2 it has moved towards chosen.
    margins = [values["dpo/train/rewards_margins"] for values in logged["dpo"]]
    assert margins[0] == 0.0 and margins[1] > 0
    assert unchanged(trainable(sft_model), load_causal_lm(tmp_path / "dpo" / "model")[0]) == []


def test_unpaired_feedback_passes_for_kto_and_is_refused_where_rm_or_dpo_read_pairs(tmp_path):
    from rlhf_pipeline.trainers.data import DataConfig
    from rlhf_pipeline.validators import stage as data

    rows = [{"prompt": f"sort {n}1 -> ", "completion": f"1{n}", "label": n % 2 == 0} for n in range(2, 10)]
    unpaired = DatasetSpec(path=str(write_jsonl(tmp_path / "feedback.jsonl", rows)))
    config = DataConfig(preference=unpaired, preference_eval=None)
    metrics = data.train(config, SMALL_MODEL, {}, tmp_path / "kto-out", tmp_path / "kto-work", pairs_for={})
    assert metrics["data/preference/rows"] == 8.0
    with pytest.raises(
        ValueError,
        match=r"feedback\.jsonl: rule 'paired_for_readers' failed for 8 of 8 rows .*rm, dpo of this run need pairs",
    ):
        data.train(
            config,
            SMALL_MODEL,
            {},
            tmp_path / "dpo-out",
            tmp_path / "dpo-work",
            pairs_for={"preference": ("rm", "dpo")},
        )
    assert not (tmp_path / "dpo-out" / "datasets").exists()  # nothing written half-way


def test_a_gate_on_exact_match_needs_the_reference_column_which_data_checks_where_the_parameters_could_not(tmp_path):
    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.validators.stage import check_datasets
    from tests.foreign_models import chat_data

    # A hub id's columns are unknown to the parameters: the gate on exact match is allowed there, and data checks it.
    hub = load_params(
        "tiny", ["algorithm=kto", "eval.use_reward_model=false", "data.prompts_eval.path=org/heldout-prompts"]
    )
    assert hub.gate().gate_metric == "eval/heldout/exact_match_gain_vs_champion"
    assert hub.required_columns() == {"prompts_eval": ("answer",)}
    assert load_params("tiny").required_columns() == {}  # the reward model's win rate needs no reference
    # The local stand-in of such a dataset, without answers: refused before any training, naming the rule and the fix.
    overrides = chat_data(tmp_path / "chat")
    params = load_params("tiny", [*overrides, "rewards.reward_model_weight=1", "rewards.functions=[]"])
    passed, failures = check_datasets(
        params.data, None, {}, tmp_path / "report", required_columns=hub.required_columns()
    )
    assert "prompts_eval" not in passed and len(failures) == 1
    assert (
        "rule 'required_columns'" in str(failures[0])
        and "no column ['answer']" in str(failures[0])
        and "eval.answer_column" in str(failures[0])
    )


def test_text_keeps_its_meaning_a_csv_column_is_typed_only_when_every_value_reads_back(tmp_path):
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt,answer,code,score,flag\nsort 0119 -> ,0119,1e3,0.5,true\nsort 12 -> ,12,00123,2.0,False\n")
    rows = load_source(DatasetSpec(path=str(csv)))
    assert rows["answer"] == ["0119", "12"] and rows["code"] == ["1e3", "00123"]  # pandas' guess: 119, 1000.0, 123
    assert rows["score"] == [0.5, 2.0] and rows["flag"] == [True, False]


def test_a_json_reference_column_of_strings_and_numbers_is_refused_naming_it(tmp_path):
    mixed = tmp_path / "prompts.jsonl"
    mixed.write_text('{"prompt": "a", "answer": "00123"}\n{"prompt": "b", "answer": 5}\n')
    with pytest.raises(ValueError, match=r"rule 'one_type_per_column' failed: column 'answer' holds string and number"):
        load_source(DatasetSpec(path=str(mixed)))  # `datasets` would read "00123" as 123


def test_duplicate_rows_are_reported_with_the_row_they_repeat_and_kept(tmp_path):
    import json

    from rlhf_pipeline.trainers.data import DataConfig
    from rlhf_pipeline.validators import stage as data

    pairs = [{"prompt": f"sort {n}1 -> ", "chosen": f"1{n}", "rejected": f"{n}1"} for n in range(2, 9)]
    conversations = [
        {"messages": [{"role": "user", "content": f"sort {n}"}, {"role": "assistant", "content": str(n)}]}
        for n in (12, 34, 56)
    ]
    preference = DatasetSpec(path=str(write_jsonl(tmp_path / "prefs.jsonl", [*pairs, pairs[1], pairs[4], pairs[1]])))
    sft = DatasetSpec(path=str(write_jsonl(tmp_path / "chat.jsonl", [*conversations, conversations[0]])))
    config = DataConfig(sft=sft, preference=preference, preference_eval=None)
    metrics = data.train(config, SMALL_MODEL, {}, tmp_path / "out", tmp_path / "work", pairs_for={})

    assert metrics["data/preference/rows"] == 10.0  # kept: reported, not refused
    assert metrics["data/preference/duplicate_rows"] == 2 + 1 and metrics["data/sft/duplicate_rows"] == 1
    assert "data/prompts_eval/duplicate_rows" not in metrics  # the control: the bundled held-out prompts differ
    report = json.loads((tmp_path / "out" / "report" / "preference" / "validation.json").read_text())
    [rule] = [rule for rule in report["rules"] if rule["rule"] == "no_duplicate_rows"]
    assert rule["success"] and rule["failed_count"] == 3
    assert [(e["row"], e["value"]) for e in rule["examples"]] == [
        (7, "same as row 1"),
        (8, "same as row 4"),
        (9, "same as row 1"),
    ]
