"""Iterated feedback and made pairs in the run's parameters (issues 15 and 27): which stages a run plans and what each
takes, decided and refused before anything loads."""

import pytest
from pydantic import ValidationError

from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.flows.plan import stages, upstream
from tests.helpers import CI_PRESET

LENGTH = "pairs.function=tests.helpers:length_reward"


def test_made_pairs_feed_the_pair_readers_and_the_preference_file_may_be_left_out():
    params = load_params(CI_PRESET, ["data.preference=null", "pairs.enabled=true", LENGTH])
    assert stages(params) == ["data", "sft", "pairs", "rm", "dpo", "eval", "registry"]
    assert upstream(params, "pairs") == ("data", "sft")
    assert "pairs" in upstream(params, "dpo") and "pairs" in upstream(params, "rm")
    # Off, nothing reads made pairs and a stage that reads the given ones needs them named.
    with pytest.raises(ValidationError, match="data.preference is null and rm reads it"):
        load_params(CI_PRESET, ["data.preference=null", LENGTH])
    # Trained on both, the given ones must be there.
    with pytest.raises(ValidationError, match="data.preference is null and rm reads it"):
        load_params(CI_PRESET, ["data.preference=null", "pairs.enabled=true", "pairs.train_on=both", LENGTH])


def test_the_reward_model_as_labeller_trains_first_on_the_given_pairs_and_labels_for_dpo():
    params = load_params(
        CI_PRESET, ["pairs.enabled=true", "pairs.labeller=reward_model", "eval.use_reward_model=false"]
    )
    assert "rm" in stages(params) and upstream(params, "pairs") == ("data", "sft", "rm")
    assert "pairs" not in upstream(params, "rm") and "pairs" in upstream(params, "dpo")


def test_feedback_rounds_are_refused_where_pairs_would_change_nothing_or_have_no_labeller():
    with pytest.raises(ValidationError, match=r"algorithm=grpo optimises rewards.functions alone"):
        load_params(CI_PRESET, ["algorithm=grpo", "rewards.reward_model_weight=0", "feedback.rounds=1", LENGTH])
    with pytest.raises(ValidationError, match=r"it cannot label them itself \(pairs.labeller=reward_model\)"):
        load_params(
            CI_PRESET,
            ["algorithm=ppo", "rewards.reward_model_weight=1", "pairs.labeller=reward_model", "feedback.rounds=1"],
        )
    with pytest.raises(ValidationError, match=r"feedback.rounds=2 makes pairs with pairs.labeller=judge, which needs"):
        load_params(CI_PRESET, ["feedback.rounds=2", "pairs.labeller=judge"])
    # An offline algorithm's rounds: pairs are planned even with the first round's switched off.
    params = load_params(CI_PRESET, ["feedback.rounds=1", LENGTH])
    assert "pairs" in stages(params) and "pairs" not in upstream(params, "dpo")
