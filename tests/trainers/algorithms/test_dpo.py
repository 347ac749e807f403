import pytest
from pydantic import ValidationError

from rlhf_pipeline.trainers.algorithms import dpo
from rlhf_pipeline.trainers.models.load import load_causal_lm
from tests.helpers import FAST, trainable, unchanged, write_data_dir


def test_dpo_moves_the_policy_towards_chosen(tmp_path, untrained_sft):
    data = write_data_dir(tmp_path / "data")
    before = trainable(load_causal_lm(untrained_sft)[0])
    logged: list[dict] = []
    metrics = dpo.train(
        dpo.DpoConfig(max_steps=10, beta=0.1, loss_type=["sigmoid", "sft"], **FAST),
        untrained_sft,
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append(values),
    )
    after, _ = load_causal_lm(tmp_path / "out" / "model")
    assert unchanged(before, after) == []
    margins = [values["dpo/train/rewards_margins"] for values in logged if "dpo/train/rewards_margins" in values]
    # Step 1 scores the policy before its first update, when it still is the reference: no implicit reward yet.
    assert len(margins) == 10 and margins[0] == 0.0
    assert metrics["dpo/train/rewards_margins"] == margins[-1] > 0


def test_loss_weights_must_match_loss_types():
    with pytest.raises(ValidationError, match=r"loss_weights has 1 entries but loss_type has 2"):
        dpo.DpoConfig(loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValidationError):
        dpo.DpoConfig(loss_type=["not_a_loss"])
