"""The `pairs` stage's two parts (issue 27): sampling the starting policy, and labelling the samples into pairs that the
preference rules check, by a function, a judge (both orders), people or the reward model."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rlhf_pipeline.tasks.pairs import preference_rules
from rlhf_pipeline.trainers.data import load_split
from rlhf_pipeline.trainers.pairs import stage as made
from rlhf_pipeline.trainers.rewards.judges import JudgeConfig
from rlhf_pipeline.validators.report import DataValidationError
from tests.helpers import write_data_dir

EXACT = "rlhf_pipeline.trainers.rewards.sort_task:exact_match"
LENGTH = "tests.helpers:length_reward"


def first_always(prompts, completions_a, completions_b):
    """A judge that prefers whatever it is shown first: pure position bias."""
    return [1.0] * len(prompts)


def longer(prompts, completions_a, completions_b):
    """A consistent judge: the longer answer is better."""
    return [1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5 for a, b in zip(completions_a, completions_b)]


def distinct_pairs(answers: list[str]) -> list[tuple[str, str]]:
    """Every two different answers of a prompt, in their order: the pairs a judge is shown."""
    return [(a, b) for i, a in enumerate(answers) for b in answers[i + 1 :] if a != b]


def write_samples(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / made.SAMPLES).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


ROWS = [
    {"id": 0, "prompt": "sort 21 -> ", "completions": ["21", "12", "1", "12"], "answer": "12"},  # right and wrong
    {"id": 1, "prompt": "sort 31 -> ", "completions": ["13", "13", "13", "13"], "answer": "13"},  # all equal
    {"id": 2, "prompt": "sort 54 -> ", "completions": ["54", "55", "44", "5"], "answer": "45"},  # all wrong: a tie
    {"id": 3, "prompt": "sort 76 -> ", "completions": ["", "67", " ", "7"], "answer": "67"},  # blanks are never picked
]


@pytest.fixture
def data_dir(tmp_path):
    return write_data_dir(tmp_path / "data", rows=16)


def test_a_verifier_keeps_right_vs_wrong_and_counts_what_it_drops(tmp_path, data_dir):
    samples = write_samples(tmp_path / "samples", ROWS)
    cfg = made.PairsConfig(enabled=True, function=EXACT)
    metrics = made.label(cfg, samples, data_dir, tmp_path / "out")
    pairs = made.read_pairs(tmp_path / "out")
    assert [(p["id"], p["chosen"], p["rejected"], p["margin"]) for p in pairs] == [
        (0, "12", "21", 1.0),
        (3, "67", "7", 1.0),
    ]
    assert all(p["labeller"] == "function" and p["round"] == 0 for p in pairs)
    assert metrics["pairs/made"] == 2 and metrics["pairs/dropped/all_equal"] == 1 and metrics["pairs/dropped/ties"] == 1
    assert metrics["pairs/blank_answers"] == 2
    trained = load_split(tmp_path / "out", "preference")
    assert trained.column_names == ["prompt", "chosen", "rejected"] and trained["chosen"] == ["12", "67"]
    summary = json.loads((tmp_path / "out" / made.SUMMARY).read_text())
    assert summary["labeller"] == "function" and summary["metrics"]["pairs/made"] == 2


def test_a_score_per_answer_picks_best_and_worst_and_min_margin_drops_close_calls(tmp_path, data_dir):
    samples = write_samples(tmp_path / "samples", ROWS)
    made.label(made.PairsConfig(enabled=True, function=LENGTH), samples, data_dir, tmp_path / "a")
    by_id = {p["id"]: p for p in made.read_pairs(tmp_path / "a")}
    assert {i: (p["chosen"], p["rejected"], p["margin"]) for i, p in by_id.items()} == {
        0: ("21", "1", 1.0),  # the first of the longest, the shortest
        2: ("54", "5", 1.0),
        3: ("67", "7", 1.0),
    }
    with pytest.raises(ValueError, match=r"kept no pair .*3 ties.*lower pairs.min_margin"):
        made.label(made.PairsConfig(enabled=True, function=LENGTH, min_margin=1.0), samples, data_dir, tmp_path / "b")


def test_nothing_kept_fails_naming_why_and_publishes_nothing(tmp_path, data_dir):
    samples = write_samples(tmp_path / "samples", [ROWS[1], ROWS[2]])
    with pytest.raises(ValueError, match=r"kept no pair of the 2 prompts sampled \(1 ties, 1 all_equal"):
        made.label(made.PairsConfig(enabled=True, function=EXACT), samples, data_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_judge_is_asked_both_orders_and_position_bias_alone_makes_no_pair(tmp_path, data_dir):
    samples = write_samples(tmp_path / "samples", [ROWS[0], ROWS[2]])
    biased = made.PairsConfig(
        enabled=True, labeller="judge", judge=JudgeConfig(path="tests.trainers.pairs.test_stage:first_always")
    )
    with pytest.raises(ValueError, match="kept no pair"):
        made.label(biased, samples, data_dir, tmp_path / "biased")
    fair = biased.model_copy(update={"judge": JudgeConfig(path="tests.trainers.pairs.test_stage:longer")})
    metrics = made.label(fair, samples, data_dir, tmp_path / "fair")
    # "12" ties "21" and beats "1": its mean win (0.75 over two games) tops "21"'s (2/3 over three).
    assert [(p["chosen"], p["rejected"]) for p in made.read_pairs(tmp_path / "fair")] == [("12", "1"), ("54", "5")]
    assert metrics["pairs/judge/first_position_rate"] == pytest.approx(0.5)
    # Agreement with the held-out preferences is the judge's verdict on each of their 16 pairs (both orders): the
    # bundled pairs mostly hold a right and a wrong answer of one length, which "longer" calls a tie (0.5).
    from datasets import Dataset

    held = Dataset.from_parquet(str(data_dir / "datasets" / "preference_eval.parquet"))
    verdicts = [
        1.0 if len(c) > len(r) else 0.0 if len(c) < len(r) else 0.5 for c, r in zip(held["chosen"], held["rejected"])
    ]
    assert metrics["pairs/labeller_agreement_pairs"] == len(verdicts) == 16
    assert metrics["pairs/labeller_agreement"] == pytest.approx(sum(verdicts) / 16)


def test_people_choose_a_or_b_ties_and_unlabelled_pairs_are_dropped(tmp_path, data_dir):
    samples = write_samples(tmp_path / "samples", ROWS)
    shown = made.people_pairs(made.read_samples(samples), max_pairs=10)
    # The all-equal prompt is not shown; the blank answers are skipped for A and B.
    assert [(p["pair"], p["id"], p["a"], p["b"]) for p in shown] == [
        (0, 0, "21", "12"),
        (1, 2, "54", "55"),
        (2, 3, "67", "7"),
    ]
    cfg = made.PairsConfig(enabled=True, labeller="people")
    metrics = made.label(cfg, samples, data_dir, tmp_path / "out", labels={0: "B", 1: "tie"})
    assert [(p["chosen"], p["rejected"]) for p in made.read_pairs(tmp_path / "out")] == [("12", "21")]
    assert metrics["pairs/dropped/ties"] == 1 and metrics["pairs/dropped/unlabelled"] == 1
    assert "pairs/labeller_agreement" not in metrics  # people are not asked about the held-out pairs


def test_training_on_both_appends_the_given_pairs_and_earlier_rounds_are_kept(tmp_path, data_dir):
    samples = write_samples(tmp_path / "samples", ROWS)
    cfg = made.PairsConfig(enabled=True, function=EXACT, train_on="both")
    metrics = made.label(cfg, samples, data_dir, tmp_path / "r1", round_=1)
    given = load_split(data_dir, "preference")
    trained = load_split(tmp_path / "r1", "preference")
    assert len(trained) == 2 + len(given) and trained["chosen"][2:] == given["chosen"]
    assert metrics["pairs/train_rows"] == len(trained)
    made.label(
        cfg.model_copy(update={"train_on": "made"}), samples, data_dir, tmp_path / "r2", 2, earlier=tmp_path / "r1"
    )
    assert [p["round"] for p in made.read_pairs(tmp_path / "r2")] == [1, 1, 2, 2]


def test_made_pairs_pass_the_preference_rules_before_they_are_published(tmp_path, data_dir, monkeypatch):
    samples = write_samples(tmp_path / "samples", ROWS)
    # A labeller bug that hands a blank answer through: the preference rules name the rule and the row.
    real = made._reply
    monkeypatch.setattr(made, "_reply", lambda prompt, text: "  " if text == "21" else real(prompt, text))
    with pytest.raises(DataValidationError, match=r"text_not_blank.*row 0"):
        made.label(
            made.PairsConfig(enabled=True, function=EXACT), samples, data_dir, tmp_path / "out", check=preference_rules
        )
    assert not (tmp_path / "out").exists()


def test_the_labeller_is_named_before_anything_runs():
    with pytest.raises(ValidationError, match="pairs.labeller=function, which needs pairs.function"):
        made.PairsConfig(enabled=True)
    with pytest.raises(ValidationError, match="needs pairs.judge"):
        made.PairsConfig(enabled=True, labeller="judge")
    with pytest.raises(ValidationError, match="no_such"):
        made.PairsConfig(function="no_such.module:score")
    made.PairsConfig(labeller="judge")  # switched off: nothing to name


def test_sampling_draws_n_answers_per_prompt_with_the_prompts_columns(tmp_path, untrained_sft):
    data = write_data_dir(tmp_path / "data", rows=32)
    cfg = made.PairsConfig(samples_per_prompt=3, max_prompts=5, max_new_tokens=3, batch_size=2)
    metrics = made.sample(cfg, untrained_sft, data, tmp_path / "out")
    rows = made.read_samples(tmp_path / "out")
    prompts = load_split(data, "prompts")
    assert len(rows) == 5 and all(len(row["completions"]) == 3 for row in rows)
    assert all(
        prompts[row["id"]]["prompt"] == row["prompt"] and prompts[row["id"]]["answer"] == row["answer"] for row in rows
    )
    assert metrics["pairs/samples/answers"] == 15
    # Sampled, not greedy: the 15 answers of an untrained model are not all one string.
    assert len({answer for row in rows for answer in row["completions"]}) > 1
    again = made.sample(cfg, untrained_sft, data, tmp_path / "again")  # seeded: the same draws
    assert made.read_samples(tmp_path / "again") == rows and again["pairs/samples/answers"] == 15


def test_an_lm_judge_labels_and_its_position_bias_is_measured(tmp_path, data_dir, untrained_sft):
    samples = write_samples(tmp_path / "samples", [ROWS[0], ROWS[2]])
    cfg = made.PairsConfig(enabled=True, labeller="judge", judge=JudgeConfig(path=str(untrained_sft), batch_size=4))
    assert cfg.uses_device  # an LM judge is loaded on the device, so labelling holds the slot
    metrics = made.label(cfg, samples, data_dir, tmp_path / "out")
    # Its position bias is its mean preference for the answer shown first, over every pair in both orders: asked
    # again here, the judge gives the figure the stage measured, and an untrained LM's is not a neutral 0.5.
    from rlhf_pipeline.trainers.rewards.judges import load_judge

    shown = [(row["prompt"], a, b) for row in (ROWS[0], ROWS[2]) for a, b in distinct_pairs(row["completions"])]
    prompts = [prompt for prompt, _, _ in shown]
    first = [made._reply(prompt, a) for prompt, a, _ in shown]
    second = [made._reply(prompt, b) for prompt, _, b in shown]
    judge = load_judge(cfg.judge)
    verdicts = [*judge(prompts, first, second), *judge(prompts, second, first)]
    assert metrics["pairs/judge/first_position_rate"] == pytest.approx(sum(verdicts) / len(verdicts), abs=1e-6)
    assert metrics["pairs/judge/first_position_rate"] != pytest.approx(0.5, abs=1e-3)
    assert metrics["pairs/made"] == len(made.read_pairs(tmp_path / "out")) >= 1
    assert metrics["pairs/labeller_agreement_pairs"] == 16
