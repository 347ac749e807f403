"""The run's plan (flows/plan.py), without Prefect: the steps of every algorithm with the pairs off, on, labelled by
the reward model, and with two feedback rounds."""

import pytest

from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.flows.plan import describe, last_policy_and_report, plan, stages
from rlhf_pipeline.tasks.stages import ALGORITHMS, BY_NAME

VARIANTS = {
    "pairs off": [],
    "pairs on": ["pairs.enabled=true"],
    "labeller = reward model": ["pairs.enabled=true", "pairs.labeller=reward_model"],
    "feedback rounds = 2": ["feedback.rounds=2", "rewards.reward_model_weight=1"],
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_step_takes_earlier_steps_and_waits_for_one_and_the_policy_takes_what_the_run_makes(algorithm, variant):
    params = load_params("tiny", [f"algorithm={algorithm}", *VARIANTS[variant]])
    steps = plan(params)
    names = [step.name for step in steps]
    assert len(set(names)) == len(names)
    for step in steps[1:]:
        earlier = set(names[: names.index(step.name)])
        assert set(step.inputs.values()) <= earlier, step
        # Every stage but the registry waits for a step before it (the device stages train one at a time).
        assert (step.after in earlier) if step.stage != "registry" else step.after is None, step
    assert {step.stage for step in steps} == set(stages(params))
    policy, report = last_policy_and_report(steps)
    assert policy == [step.name for step in steps if step.stage == algorithm][-1]
    row = BY_NAME[algorithm]
    policies = [step for step in steps if step.stage == algorithm]
    # The made pairs feed the policy that reads pairs, whoever labels them.
    assert ("pairs" in policies[0].inputs) == ("pairs" in row.upstream and params.pairs.enabled)
    assert ("rm" in policies[0].inputs) == (row.online and params.rewards.uses_reward_model)
    rounds = params.feedback.rounds
    assert len(policies) == rounds + 1 and [step.round for step in policies] == list(range(rounds + 1))
    for round_ in range(1, rounds + 1):
        made = f"pairs@{round_}"
        sampled = policies[round_ - 1].name
        assert steps[names.index(made)].inputs["policy"] == sampled  # the round samples the last policy
        trained = policies[round_].inputs
        # Online: a reward model of the round trains on its pairs; offline: the policy trains on them.
        if row.online:
            assert trained["rm"] == f"rm@{round_}" and steps[names.index(f"rm@{round_}")].inputs["pairs"] == made
        else:
            assert trained["pairs"] == made and "rm" not in trained
        assert trained["sft"] == sampled  # from the last round's policy (feedback.from_sft=false)
        assert steps[names.index(made)].keep == (f"pairs@{round_ - 1}" if round_ > 1 else None)


def lines(*args: str) -> list[str]:
    return describe(plan(load_params("tiny", list(args)))).splitlines()


def test_the_plans_of_dpo_and_ppo_step_by_step():
    assert lines("algorithm=dpo", "pairs.enabled=true", "pairs.labeller=reward_model") == [
        "data         <- -",
        "sft          <- data",
        "rm           <- data, sft",  # the reward model that labels the pairs trains first, on the given ones
        "pairs        <- data, sft, rm",
        "dpo          <- data, sft, pairs",
        "eval         <- data, sft, policy=dpo, rm, pairs",
        "registry     <- policy=dpo, report=eval, data, sft, pairs, rm, dpo, eval",
    ]
    assert lines("algorithm=dpo", "pairs.enabled=true") == [
        "data         <- -",
        "sft          <- data",
        "pairs        <- data, sft",
        "rm           <- data, sft, pairs",
        "dpo          <- data, sft, pairs",
        "eval         <- data, sft, policy=dpo, rm, pairs",
        "registry     <- policy=dpo, report=eval, data, sft, pairs, rm, dpo, eval",
    ]
    assert lines("algorithm=ppo", "feedback.rounds=2", "rewards.reward_model_weight=1") == [
        "data         <- -",
        "sft          <- data",
        "rm           <- data, sft",
        "ppo          <- data, sft, rm",
        "pairs@1      <- data, sft, policy=ppo",
        "rm@1         <- data, sft, pairs=pairs@1",
        "ppo@1        <- data, sft=ppo, rm=rm@1",
        "pairs@2      <- data, sft, policy=ppo@1  (keeps pairs@1)",
        "rm@2         <- data, sft, pairs=pairs@2",
        "ppo@2        <- data, sft=ppo@1, rm=rm@2",
        "eval         <- data, sft, policy=ppo@2, rm=rm@2, pairs=pairs@2",
        "registry     <- policy=ppo@2, report=eval, data, sft, pairs=pairs@2, rm=rm@2, ppo=ppo@2, eval",
    ]
    # No reward model where nothing scores with it, no registry where it is off.
    assert lines("algorithm=dpo", "eval.use_reward_model=false", "registry.enabled=false") == [
        "data         <- -",
        "sft          <- data",
        "dpo          <- data, sft",
        "eval         <- data, sft, policy=dpo",
    ]


def test_rlhf_params_plan_prints_the_steps_and_rlhf_check_shows_them(capsys):
    from rlhf_pipeline.cli import main

    assert main(["params", "--plan", "--set", "algorithm=kto", "--set", "registry.enabled=false"]) == 0
    assert capsys.readouterr().out.splitlines() == lines("algorithm=kto", "registry.enabled=false")
