"""Every offline algorithm moves the policy towards chosen: trained from the untrained small model on the bundled pairs,
every trainable tensor moves, chosen answers gain log-probability against rejected ones, and the metric the algorithm
optimises moves the right way in its own log."""

import pytest
from datasets import Dataset

from rlhf_pipeline.trainers.algorithms import dpo, kto, orpo
from rlhf_pipeline.trainers.models.load import load_causal_lm
from rlhf_pipeline.trainers.rewards.metrics import sequence_logprobs
from tests.helpers import FAST, trainable, unchanged, write_data_dir

ALGORITHMS = {
    # module, config, (the logged metric it must move, its first value's bound, how far it must move)
    "dpo": (dpo, dpo.DpoConfig(max_steps=10, beta=0.1, loss_type=["sigmoid", "sft"], **FAST), "rewards_margins"),
    "kto": (kto, kto.KtoConfig(**dict(FAST, max_steps=8, per_device_train_batch_size=8)), "rewards_chosen"),
    "orpo": (orpo, orpo.OrpoConfig(max_steps=10, beta=1.0, **FAST), "log_odds_chosen"),
}


def mean(values) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_offline_algorithm_moves_the_policy_towards_chosen(name, tmp_path, untrained_sft):
    module, config, metric = ALGORITHMS[name]
    data = write_data_dir(tmp_path / "data")
    before, tokenizer = load_causal_lm(untrained_sft)
    weights = trainable(before)
    logged: list[dict[str, float]] = []
    final = module.train(
        config, untrained_sft, data, tmp_path / "out", tmp_path / "work", lambda values, step: logged.append(values)
    )
    after, _ = load_causal_lm(tmp_path / "out" / "model")
    assert unchanged(weights, after) == []
    # log pi_after - log pi_before of chosen against rejected: the pairs' chosen answers became the likelier.
    pairs = Dataset.from_parquet(str(data / "datasets" / "preference.parquet"))

    def gain(column: str) -> float:
        prompts, answers = pairs["prompt"], pairs[column]
        trained = sequence_logprobs(after, tokenizer, prompts, answers)
        return mean([a - b for a, b in zip(trained, sequence_logprobs(before, tokenizer, prompts, answers))])

    assert gain("chosen") - gain("rejected") > 0.1
    # The algorithm's own measure of it: it starts near nothing and ends ahead.
    curve = [values[f"{name}/train/{metric}"] for values in logged if f"{name}/train/{metric}" in values]
    assert len(curve) >= 8 and abs(curve[0]) < 0.05 and curve[-1] > curve[0] + 0.01
    assert final[f"{name}/train/{metric}"] == curve[-1]
