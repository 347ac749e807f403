"""End to end with each online algorithm; switching algorithms reuses the cached sft and rm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlhf_pipeline.flows.params import load_params
from tests.flows.helpers import CI_PRESET, run, task_states

pytestmark = pytest.mark.slow  # a pipeline run end to end: the fast loop skips it (-m 'not slow')

ONLINE_FAST = [  # a reward that varies on an untrained model's samples, mixed with the reward model
    "rewards.functions=[{path: 'tests.helpers:length_reward', weight: 1.0}]",
    "rewards.reward_model_weight=0.5",
]
# Every step: every online stage's curves, disagreement too
PROBES = [
    "grpo.eval_steps=1",
    "rloo.eval_steps=1",
    "ppo.eval_steps=1",
    "rm.ensemble_size=2",
]
HELDOUT_CURVES = ("kl", "sqrt_kl", "exact_match", "proxy_reward", "disagreement", "score")


def assert_heldout_curves(summary: dict, stage: str, steps: int) -> None:
    """The stage's MLflow run holds one point per step of each held-out curve; eval plotted them on Gao et al.'s
    axes."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    parent = client.get_run(summary["mlflow_run_id"])
    runs = {
        r.info.run_name: r
        for r in client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    }
    for name in HELDOUT_CURVES:
        history = client.get_metric_history(runs[stage].info.run_id, f"{stage}/heldout/{name}")
        assert sorted(m.step for m in history) == list(range(1, steps + 1)), (stage, name)
    # An ensemble
    assert any(m.value > 0 for m in client.get_metric_history(runs[stage].info.run_id, f"{stage}/heldout/disagreement"))
    assert "plots/overoptimisation.png" in {a.path for a in client.list_artifacts(runs["eval"].info.run_id, "plots")}


def test_each_online_algorithm_runs_and_reuses_sft_and_rm(prefect, state):
    grpo = run(*ONLINE_FAST, *PROBES, "algorithm=grpo")
    assert grpo.is_completed(), grpo.message
    assert task_states(grpo) == {
        "data": "Completed",
        "sft": "Completed",
        "rm": "Completed",
        "grpo": "Completed",
        "eval": "Completed",
        "registry": "Completed",
    }
    assert "eval/heldout/policy_exact_match" in grpo.result()["metrics"]
    assert_heldout_curves(grpo.result(), "grpo", 2)

    for algorithm, steps in (("ppo", 2), ("rloo", 2)):
        switched = run(*ONLINE_FAST, *PROBES, f"algorithm={algorithm}")
        assert switched.is_completed(), switched.message
        states = task_states(switched)
        # ppo has no prompt-length limit, so `data` re-checks without it (rloo's limit is grpo's:
        # cached); the same frozen datasets come out, so sft and rm (keyed on their bytes) are reused.
        data = "Cached" if algorithm == "rloo" else "Completed"
        assert states == {
            "data": data,
            "sft": "Cached",
            "rm": "Cached",
            algorithm: "Completed",
            "eval": "Completed",
            "registry": "Completed",
        }
        metrics = switched.result()["metrics"]
        assert "eval/heldout/policy_exact_match" in metrics
        assert_heldout_curves(switched.result(), algorithm, steps)


def test_a_reward_function_that_does_not_import_fails_with_the_parameters(prefect, state):
    bad = "rewards.functions=[{path: 'no_such.module:score'}]"
    with pytest.raises(
        ValidationError, match=r"reward function 'no_such.module:score': module 'no_such.module' does not import"
    ):
        run(*ONLINE_FAST, "algorithm=grpo", bad)
    # Handed to the flow as the UI's form hands it (a plain block), the run fails before any stage starts.
    from rlhf_pipeline.flows.rlhf import rlhf

    params = load_params(CI_PRESET, [*ONLINE_FAST, "algorithm=grpo"])
    rewards = {"reward_model_weight": 0.5, "functions": [{"path": "no_such.module:score"}]}
    failed = rlhf(**{**dict(params), "rewards": rewards}, return_state=True)
    assert failed.is_failed() and "no_such.module:score" in str(failed.result(raise_on_failure=False))
    assert task_states(failed) == {}


def test_a_policy_that_games_its_reward_model_is_refused_promotion_with_the_numbers(prefect, state):
    """The embedded default (not the CI preset: a hack needs a model that can do the task first), shortened: the reward
    model is the only reward and nothing holds ppo back (no KL penalty, a high learning rate), so held-out exact match
    falls while the reward model's score rises; the registry refuses the policy even as a first version."""
    from rlhf_pipeline.flows.rlhf import rlhf

    hack = [
        "algorithm=ppo",
        "rewards.functions=[]",
        "rewards.reward_model_weight=1",
        "sft.max_steps=100",
        "rm.max_steps=50",
        "ppo.kl_coef=0",
        "ppo.target_kl=null",
        "ppo.learning_rate=3e-4",
        "ppo.total_episodes=1280",
        "ppo.eval_steps=5",
        "ppo.keep_best=false",  # the last policy is published: the one that games the reward model
        "eval.max_prompts=200",
    ]
    hacked = rlhf(**dict(load_params("tiny", hack)), return_state=True)
    assert hacked.is_completed(), hacked.message
    summary = hacked.result()
    metrics, outcome = summary["metrics"], summary["registry"]
    held = "eval/heldout/"
    assert metrics[f"{held}policy_mean_reward"] > metrics[f"{held}sft_mean_reward"]
    assert metrics[f"{held}policy_exact_match"] < metrics[f"{held}sft_exact_match"] - 0.1, metrics
    assert not outcome["promoted"], outcome
    assert outcome["reason"].startswith("reward hacking: the held-out reward-model score rose from ")
    for name in ("sft_mean_reward", "policy_mean_reward", "sft_exact_match", "policy_exact_match"):
        assert f"{metrics[held + name]:.4f}" in outcome["reason"], name
    # The held-out gold metric alone refuses it too (registry.beat_start), and the probes' best exact match is not
    # the last policy: keep_best, which chooses by the gold metric where there is one, would publish an earlier one.
    from rlhf_pipeline.tasks.gate import RegistryConfig, below_start

    assert metrics[f"{held}exact_match_gain_vs_sft_high"] < 0
    assert "does not beat its start" in below_start(RegistryConfig(hacking_gate=False), metrics)
    probes = Path(summary["artifacts"]["ppo"]) / "heldout.jsonl"
    curves = [json.loads(line) for line in probes.read_text().splitlines()]
    assert [c["score"] for c in curves] == [c["exact_match"] for c in curves]
    assert max(curves, key=lambda c: c["exact_match"])["step"] != curves[-1]["step"], curves


def test_grpo_and_rloo_on_the_reward_model_alone_beat_sft_by_10_points_with_the_defaults(prefect, state):
    """Issue 41, item 6, one seed each: the embedded default with the reward model as the only reward and nothing
    else changed but the online stages' length (80 steps of the default 150; rloo reuses grpo's sft and rm). The
    published policy, kept on the probes' held-out exact match (the last rows of prompts_eval), beats sft by 10 points
    on the rows eval scores, which the probes did not choose on (bench.learned_reward: 3 seeds of each at the full
    defaults). With sft and rm shortened as in the test above, the weaker reward model is gamed before the first
    probe."""
    from rlhf_pipeline.flows.rlhf import rlhf

    for algorithm in ("grpo", "rloo"):
        learned = [
            f"algorithm={algorithm}",
            "rewards.functions=[]",
            "rewards.reward_model_weight=1",
            f"{algorithm}.max_steps=80",
            "registry.enabled=false",
        ]
        done = rlhf(**dict(load_params("tiny", learned)), return_state=True)
        assert done.is_completed(), done.message
        summary = done.result()
        metrics, held = summary["metrics"], "eval/heldout/"
        assert metrics[f"{held}policy_exact_match"] >= metrics[f"{held}sft_exact_match"] + 0.10, (algorithm, metrics)
        assert metrics[f"{held}exact_match_gain_vs_sft_low"] > 0, algorithm
        outcome = json.loads((Path(summary["artifacts"][algorithm]) / "training.json").read_text())
        assert outcome["chosen_on_rows"] == [400, 600] and metrics[f"{held}num_left_out"] == 200
        assert metrics[f"{held}num_prompts"] == 400


def test_a_feedback_round_retrains_rm_on_the_policys_labelled_samples_then_the_policy(prefect, state):
    from mlflow.tracking import MlflowClient

    rounds = [
        "feedback.rounds=1",
        "pairs.function=tests.helpers:length_reward",
        "pairs.max_prompts=16",
        "pairs.samples_per_prompt=4",
        "pairs.max_new_tokens=4",
        "pairs.train_on=both",  # the round's rm learns the given pairs and the labelled samples
    ]
    done = run(*ONLINE_FAST, "algorithm=ppo", *rounds)
    assert done.is_completed(), done.message
    assert task_states(done) == {
        "data": "Completed",
        "sft": "Completed",
        "rm": "Completed",
        "ppo": "Completed",
        "pairs (round 1)": "Completed",
        "rm (round 1)": "Completed",
        "ppo (round 1)": "Completed",
        "eval": "Completed",
        "registry": "Completed",
    }
    summary = done.result()
    client = MlflowClient()
    parent = client.get_run(summary["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_round = {
        (r.info.run_name, r.data.tags.get("rlhf.round", "0"), r.data.tags.get("rlhf.part", "")): r for r in children
    }
    assert {("rm", "0", ""), ("rm", "1", ""), ("ppo", "0", ""), ("ppo", "1", "")} <= set(by_round)
    labelled = by_round[("pairs", "1", "labels")]
    made = labelled.data.metrics["pairs/made"]
    given = load_params(CI_PRESET).data  # the bundled preference file: 3,000 pairs
    assert made > 0 and labelled.data.metrics["pairs/train_rows"] == made + 3000, given
    assert "pairs.jsonl" in {a.path for a in client.list_artifacts(labelled.info.run_id)}
    # The round's rm trained on the round's pairs: its key names the pairs artifact.
    rm_round = by_round[("rm", "1", "")]
    manifest = json.loads((Path(rm_round.data.tags["rlhf.artifact"]) / "manifest.json").read_text())
    assert manifest["upstream"]["pairs"]["key"] == labelled.data.tags["rlhf.key"]
    # eval and the registry read the last round's policy: the artifacts the run reports are round 1's.
    assert summary["artifacts"]["ppo"] == by_round[("ppo", "1", "")].data.tags["rlhf.artifact"]
    assert summary["artifacts"]["rm"] == rm_round.data.tags["rlhf.artifact"]
    # An online algorithm that optimises reward functions alone learns nothing from pairs: refused with the parameters.
    with pytest.raises(ValidationError, match=r"feedback.rounds=1 trains on labelled pairs .*reward_model_weight=0"):
        run("algorithm=ppo", "rewards.reward_model_weight=0", *rounds)
