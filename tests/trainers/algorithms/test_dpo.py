import pytest
from pydantic import ValidationError

from rlhf_pipeline.trainers.algorithms import dpo


def test_loss_weights_must_match_loss_types():
    with pytest.raises(ValidationError, match=r"loss_weights has 1 entries but loss_type has 2"):
        dpo.DpoConfig(loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValidationError):
        dpo.DpoConfig(loss_type=["not_a_loss"])
