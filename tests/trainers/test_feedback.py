"""Iterated feedback: a round's rm samples the last policy, has the pairs labelled and trains on them too (issue 15)."""

import json

import pytest
from pydantic import ValidationError

from rlhf_pipeline.trainers import rm
from rlhf_pipeline.trainers.feedback import PAIRS, FeedbackConfig, collect_pairs, with_pairs
from rlhf_pipeline.trainers.loop import load_split
from rlhf_pipeline.trainers.sort_task import reference_labeller
from tests.helpers import FAST, write_data_dir

LABELLER = "rlhf_pipeline.trainers.sort_task:reference_labeller"


def first_always(prompts, first, second, **_):
    return [1.0] * len(first)


def one_label_short(prompts, first, second, **_):
    return [1.0] * (len(first) - 1)


def test_the_reference_labeller_prefers_the_right_answer_and_drops_what_it_cannot_tell():
    labels = reference_labeller(
        ["sort 21 -> "] * 4, ["12", "21", "12", "1"], ["21", "12", "12", "2"], answer=["12"] * 4
    )
    assert labels == [1.0, 0.0, None, None]  # right vs wrong, wrong vs right, both right, both wrong


def test_rounds_need_a_labeller_that_imports():
    with pytest.raises(ValidationError, match="needs a labeller"):
        FeedbackConfig(rounds=1)
    with pytest.raises(ValidationError, match="no_such"):
        FeedbackConfig(rounds=1, labeller="no_such.module:label")


@pytest.fixture(scope="module")
def policy(tmp_path_factory, untrained_sft):
    root = tmp_path_factory.mktemp("feedback")
    return {"root": root, "policy": untrained_sft, "data": write_data_dir(root / "data", rows=32)}


def test_a_round_collects_labelled_pairs_and_keeps_the_earlier_rounds(policy, tmp_path):
    cfg = FeedbackConfig(
        rounds=2, labeller="tests.trainers.test_feedback:first_always", prompts_per_round=8, max_new_tokens=4
    )
    first = collect_pairs(cfg, policy["policy"], policy["data"], 1, None, tmp_path / "r1")
    prompts = set(load_split(policy["data"], "prompts")["prompt"])
    assert 0 < len(first) <= 8 and all(
        p["prompt"] in prompts and p["round"] == 1 and p["chosen"] != p["rejected"] for p in first
    )
    second = collect_pairs(cfg, policy["policy"], policy["data"], 2, tmp_path / "r1" / PAIRS, tmp_path / "r2")
    assert second[: len(first)] == first and {p["round"] for p in second[len(first) :]} == {2}
    assert [json.loads(line) for line in (tmp_path / "r2" / PAIRS).read_text().splitlines()] == second
    preference = load_split(policy["data"], "preference")
    grown = with_pairs(preference, second)
    assert len(grown) == len(preference) + len(second) and grown[len(preference)]["chosen"] == second[0]["chosen"]
    with pytest.raises(ValueError, match="returned 7 labels for 8 pairs"):
        collect_pairs(
            cfg.model_copy(update={"labeller": "tests.trainers.test_feedback:one_label_short"}),
            policy["policy"],
            policy["data"],
            1,
            None,
            tmp_path / "x",
        )


def test_a_feedback_round_trains_the_reward_model_on_the_new_pairs_too(policy, tmp_path):
    cfg = FeedbackConfig(
        rounds=1, labeller="tests.trainers.test_feedback:first_always", prompts_per_round=16, max_new_tokens=4
    )
    logged: list[dict] = []
    rm.train(
        rm.RewardModelConfig(max_steps=2, **FAST),
        policy["policy"],
        policy["data"],
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append(values),
        feedback=cfg,
        policy_model=policy["policy"],
    )
    summary = json.loads((tmp_path / "out" / "feedback.json").read_text())
    pairs = (tmp_path / "out" / PAIRS).read_text().splitlines()
    assert summary == {"round": 1, "pairs": len(pairs), "new_pairs": len(pairs)} and pairs
    assert logged[0]["rm/feedback/new_pairs"] == len(pairs)
    # The next round continues the count and the file.
    rm.train(
        rm.RewardModelConfig(max_steps=2, **FAST),
        policy["policy"],
        policy["data"],
        tmp_path / "out2",
        tmp_path / "work2",
        feedback=cfg.model_copy(update={"seed": 1}),
        policy_model=policy["policy"],
        reward_model=tmp_path / "out" / "model",
    )
    again = json.loads((tmp_path / "out2" / "feedback.json").read_text())
    assert again["round"] == 2 and again["pairs"] == len(pairs) + again["new_pairs"] and again["new_pairs"] > 0


def test_people_label_the_pairs_in_a_folder_the_round_waits_on(policy, tmp_path):
    import threading
    import time

    from rlhf_pipeline.trainers.feedback import wait_for_labels

    cfg = FeedbackConfig(rounds=1, labels_dir=str(tmp_path / "labels"), prompts_per_round=6, max_new_tokens=4)
    folder = tmp_path / "labels" / "round-1"

    def rater():  # reads the pairs once they are there, prefers the second of each, drops the first pair
        while not (folder / "pairs.jsonl").is_file():
            time.sleep(0.05)
        rows = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
        labels = [{"id": r["id"], "label": None if r["id"] == 0 else 0} for r in rows]
        (folder / ".labels.tmp").write_text("".join(json.dumps(label) + "\n" for label in labels))
        (folder / ".labels.tmp").rename(folder / "labels.jsonl")

    thread = threading.Thread(target=rater)
    thread.start()
    pairs = collect_pairs(cfg, policy["policy"], policy["data"], 1, None, tmp_path / "out")
    thread.join()
    asked = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    expected = [
        {"prompt": r["prompt"], "chosen": r["second"], "rejected": r["first"], "round": 1}
        for r in asked[1:]
        if r["first"] != r["second"]
    ]
    assert pairs == expected and pairs
    # A label file with a bad row names the file and the line; one that misses a pair names the pair.
    (folder / "labels.jsonl").write_text('{"id": 0, "label": 1}\n{"id": 1, "label": "better"}\n')
    with pytest.raises(ValueError, match=r"labels.jsonl line 2: each line is"):
        wait_for_labels(folder, ["a", "b"], ["1", "2"], ["3", "4"], timeout_s=1)
    (folder / "labels.jsonl").write_text('{"id": 0, "label": 1}\n')
    with pytest.raises(ValueError, match=r"no label for pairs \[1\]"):
        wait_for_labels(folder, ["a", "b"], ["1", "2"], ["3", "4"], timeout_s=1)
    (folder / "labels.jsonl").unlink()
    with pytest.raises(TimeoutError, match="feedback.wait_timeout_s=0.2"):
        wait_for_labels(folder, ["a"], ["1"], ["2"], timeout_s=0.2, poll_s=0.05)
    with pytest.raises(ValidationError, match="set one"):
        FeedbackConfig(rounds=1, labeller=LABELLER, labels_dir=str(tmp_path))
