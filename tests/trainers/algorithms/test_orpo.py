import pytest
from pydantic import ValidationError

from rlhf_pipeline.check import held_models
from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.trainers.algorithms import orpo
from rlhf_pipeline.trainers.models.load import load_causal_lm
from tests.helpers import FAST, trainable, unchanged, write_data_dir


def test_orpo_moves_the_policy_towards_chosen(tmp_path, untrained_sft):
    data = write_data_dir(tmp_path / "data")
    before = trainable(load_causal_lm(untrained_sft)[0])
    logged: list[dict] = []
    metrics = orpo.train(
        orpo.OrpoConfig(max_steps=10, beta=1.0, **FAST),
        untrained_sft,
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append(values),
    )
    after, _ = load_causal_lm(tmp_path / "out" / "model")
    assert unchanged(before, after) == []
    # TRL's `log_odds_chosen` is the batch's mean log odds ratio of chosen over rejected (its `log_odds_ratio` is the
    # log-sigmoid of it); an untrained model scores both alike, and ORPO must pull chosen ahead.
    odds = [values["orpo/train/log_odds_chosen"] for values in logged if "orpo/train/log_odds_chosen" in values]
    nll = [values["orpo/train/nll_loss"] for values in logged if "orpo/train/nll_loss" in values]
    assert len(odds) == len(nll) == 10
    assert abs(odds[0]) < 0.02 and odds[-1] > odds[0] + 0.05  # 0.002 -> 0.14 here
    assert nll[-1] < nll[0]  # the SFT term folded in: the chosen sequences' NLL falls too
    assert metrics["orpo/train/log_odds_chosen"] == odds[-1]


def test_orpo_holds_no_reference_model():
    params = load_params("tiny", ["algorithm=orpo"])
    assert [held.role for held in held_models(params, "orpo")] == ["policy"]
    assert [held.role for held in held_models(params, "dpo")] == ["policy", "reference"]


def test_overrides_are_checked_against_trls_experimental_orpo_config():
    assert orpo.OrpoConfig(trl_overrides={"dataset_num_proc": 2}).trl_overrides == {"dataset_num_proc": 2}
    unknown = r"'betta' \(did you mean 'beta'\?\), which trl\.experimental\.orpo\.ORPOConfig does not have"
    with pytest.raises(ValidationError, match=unknown):
        orpo.OrpoConfig(trl_overrides={"betta": 1})
    with pytest.raises(ValidationError, match=r"'beta' is this block's field `beta`"):
        orpo.OrpoConfig(trl_overrides={"beta": 1})
