"""Reward-model ensembles, WARM, adaptive KL and the held-out probes of the online stages (issue 15)."""

import json
import statistics

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForSequenceClassification

from rlhf_pipeline.trainers.algorithms import rm
from rlhf_pipeline.trainers.data import load_split
from rlhf_pipeline.trainers.models.load import load_causal_lm
from rlhf_pipeline.trainers.models.text import prompt_ids
from rlhf_pipeline.trainers.ppo import train as ppo
from rlhf_pipeline.trainers.rewards.ensemble import TextEnsemble, aggregate, member_dirs, scoring_dirs
from rlhf_pipeline.trainers.rewards.mix import RewardsConfig, RewardScorer
from rlhf_pipeline.trainers.rewards.probes import CURVES
from tests.helpers import FAST, trainable, unchanged, write_data_dir


def test_aggregates_by_hand():
    members = [[1.0, 0.0], [3.0, 0.0], [2.0, 3.0]]  # 3 members x 2 rows
    mean, spread = aggregate(members, "mean")
    assert mean == [2.0, 1.0]
    assert spread == pytest.approx([statistics.pstdev([1, 3, 2]), statistics.pstdev([0, 0, 3])])  # 0.8165, 1.4142
    assert aggregate(members, "min")[0] == [1.0, 0.0]
    worst = aggregate(members, "mean_minus_std", std_coef=0.5)[0]
    assert worst == pytest.approx([2.0 - 0.5 * 0.8164966, 1.0 - 0.5 * 1.4142136])
    assert aggregate([[5.0, 7.0]], "min") == ([5.0, 7.0], [0.0, 0.0])  # one member: its scores, no disagreement


def test_adaptive_kl_by_hand():
    # KL twice the target: the error clips at +0.2; batch 64 over a horizon of 640 moves beta by 0.2 * 0.1 = 2%.
    assert ppo.adapted_kl_coef(0.1, kl=4.0, target=2.0, batch_size=64, horizon=640) == pytest.approx(0.102)
    # KL 10% under the target: beta shrinks by 0.1 * 0.1 = 1%.
    assert ppo.adapted_kl_coef(0.1, kl=1.8, target=2.0, batch_size=64, horizon=640) == pytest.approx(0.099)
    assert ppo.adapted_kl_coef(0.1, kl=2.0, target=2.0, batch_size=64, horizon=640) == pytest.approx(0.1)


def test_ensemble_fields_are_checked():
    with pytest.raises(ValidationError, match="ensemble_size to 2 or more"):
        rm.RewardModelConfig(weight_average=True)
    with pytest.raises(ValidationError, match="reward_model_aggregate"):
        RewardsConfig(reward_model_aggregate="median")


@pytest.fixture(scope="module")
def sft(tmp_path_factory, untrained_sft):
    from rlhf_pipeline.trainers.models.load import load_tokenizer

    root = tmp_path_factory.mktemp("ensemble")
    data = write_data_dir(root / "data", rows=64)
    return {"root": root, "sft": untrained_sft, "data": data, "tokenizer": load_tokenizer(untrained_sft)}


@pytest.fixture(scope="module")
def ensemble(sft):
    """Three members of 6 steps each."""
    out = sft["root"] / "rm3"
    logged: list[dict] = []
    metrics = rm.train(
        rm.RewardModelConfig(max_steps=6, ensemble_size=3, **FAST),
        sft["sft"],
        sft["data"],
        out,
        sft["root"] / "rm3-work",
        lambda values, step: logged.append(values),
    )
    return {"out": out, "metrics": metrics, "logged": logged}


def test_an_ensemble_trains_k_different_members_in_one_artifact(sft, ensemble):
    out = ensemble["out"]
    assert json.loads((out / "ensemble.json").read_text()) == {"members": 3, "served": "ensemble"}
    dirs = member_dirs(out / "model")
    assert dirs == [out / "members" / str(i) / "model" for i in range(3)] == scoring_dirs(out / "model")
    members = [AutoModelForSequenceClassification.from_pretrained(d) for d in dirs]
    # Different seeds and bootstrap resamples: every member's score head differs from every other's.
    heads = [m.score.weight for m in members]
    assert (
        not torch.equal(heads[0], heads[1])
        and not torch.equal(heads[1], heads[2])
        and not torch.equal(heads[0], heads[2])
    )
    # The served folder is member 0, weight for weight.
    assert unchanged(
        trainable(members[0]), AutoModelForSequenceClassification.from_pretrained(out / "model")
    ) == sorted(trainable(members[0]))
    # Each member's curves and final figures, under its own prefix; member 0's are the stage's own too.
    for i in range(3):
        assert f"rm/member_{i}/train_loss" in ensemble["metrics"], sorted(ensemble["metrics"])
        assert any(f"rm/member_{i}/train_accuracy" in values for values in ensemble["logged"])
    assert ensemble["metrics"]["rm/train/loss"] == ensemble["metrics"]["rm/member_0/train_loss"]


def test_the_scorer_aggregates_the_members_and_reports_their_disagreement(sft, ensemble):
    prompts = load_split(sft["data"], "prompts")["prompt"][:6]
    ids = [prompt_ids(sft["tokenizer"], p) + prompt_ids(sft["tokenizer"], "123") for p in prompts]
    one = [RewardScorer.member_scores(m, ids) for m in RewardScorer(RewardsConfig(), ensemble["out"] / "model").models]
    assert len(one) == 3
    for how in ("mean", "min", "mean_minus_std"):
        scorer = RewardScorer(RewardsConfig(reward_model_aggregate=how), ensemble["out"] / "model")
        total, components = scorer(prompts, ["123"] * 6, {}, ids=ids)
        expected, spread = aggregate(one, how)
        assert total == pytest.approx(expected) and components["reward_model_std"] == pytest.approx(spread)
        assert min(spread) > 0  # the members disagree
    # The same members scoring text, as GRPO/RLOO get them: the aggregate of their scores of the same rows.
    text = TextEnsemble(member_dirs(ensemble["out"] / "model"), "min")
    scores = text(prompts=prompts, completions=["123"] * 6)
    assert (
        scores == pytest.approx([min(col) for col in zip(*text.members(prompts, ["123"] * 6))])
        and len(text.last_spread) == 6
    )


def test_warm_serves_the_members_weight_average(sft):
    out = sft["root"] / "warm"
    rm.train(
        rm.RewardModelConfig(max_steps=4, ensemble_size=2, weight_average=True, **FAST),
        sft["sft"],
        sft["data"],
        out,
        sft["root"] / "warm-work",
    )
    assert json.loads((out / "ensemble.json").read_text())["served"] == "average"
    assert scoring_dirs(out / "model") == [out / "model"]  # one model scores the policy
    a, b, average = (
        AutoModelForSequenceClassification.from_pretrained(d) for d in [*member_dirs(out / "model"), out / "model"]
    )
    for name, tensor in average.state_dict().items():
        torch.testing.assert_close(tensor, (a.state_dict()[name] + b.state_dict()[name]) / 2)
    # The members trained apart from one shared head initialisation
    assert not torch.equal(a.score.weight, b.score.weight)


PROBED = dict(
    rollout_batch_size=8,
    num_mini_batches=2,
    num_ppo_epochs=2,
    total_episodes=48,
    response_length=6,
    learning_rate=3e-3,
    temperature=1.0,
    logging_steps=1,
    num_threads=1,
    eval_steps=2,
    eval_prompts=16,
    save_steps=100,
)


def test_ppo_probes_the_held_out_prompts_and_publishes_the_best_probe(sft, ensemble, tmp_path):
    logged: list[tuple[int, dict]] = []
    cfg = ppo.PpoConfig(**PROBED, target_kl=0.5, kl_horizon=16)
    ppo.train(
        cfg,
        RewardsConfig(reward_model_weight=1.0, reward_model_aggregate="mean_minus_std"),
        sft["sft"],
        ensemble["out"] / "model",
        sft["data"],
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    probes = [(step, v) for step, v in logged if "ppo/heldout/kl" in v]
    assert [step for step, _ in probes] == [2, 4, 6]  # every eval_steps, and the last update
    for _, values in probes:
        assert {
            f"ppo/heldout/{n}" for n in ("kl", "sqrt_kl", "exact_match", "proxy_reward", "disagreement", "score")
        } <= set(values)
        assert values["ppo/heldout/disagreement"] > 0
        # The held-out prompts have answers: exact match, the gold metric, is what the kept policy is chosen by.
        assert values["ppo/heldout/score"] == values["ppo/heldout/exact_match"]
    curves = [json.loads(line) for line in (tmp_path / "out" / CURVES).read_text().splitlines()]
    assert [c["step"] for c in curves] == [2, 4, 6] and curves[-1]["kl"] == probes[-1][1]["ppo/heldout/kl"]
    # Adaptive KL: the coefficient is logged every update and moves from kl_coef (0.05) with the measured KL.
    coefs = [v["ppo/train/kl_coef"] for _, v in logged if "ppo/train/kl_coef" in v]
    assert len(coefs) == 6 and coefs[0] == 0.05 and len(set(coefs)) > 1
    # The published policy is the best probe's, and training.json says which.
    outcome = json.loads((tmp_path / "out" / "training.json").read_text())
    best = max(curves, key=lambda c: c["score"])
    assert outcome["kept_step"] == best["step"] and outcome["kept_score"] == pytest.approx(best["score"])
    published, _ = load_causal_lm(tmp_path / "out" / "model")
    kept = __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        tmp_path / "work" / "best-policy" / "policy.safetensors"
    )
    for name, tensor in published.state_dict().items():
        if name in kept:
            torch.testing.assert_close(tensor, kept[name])


def test_without_keep_best_the_last_policy_is_published(sft, ensemble, tmp_path):
    cfg = ppo.PpoConfig(**{**PROBED, "total_episodes": 16}, keep_best=False)
    ppo.train(
        cfg, RewardsConfig(), sft["sft"], ensemble["out"] / "model", sft["data"], tmp_path / "out", tmp_path / "work"
    )
    assert "kept_step" not in json.loads((tmp_path / "out" / "training.json").read_text())
    assert not (tmp_path / "work" / "best-policy").exists() and (tmp_path / "out" / CURVES).is_file()
