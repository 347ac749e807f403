import pytest
from datasets import Dataset
from pydantic import ValidationError

from rlhf_pipeline.trainers.algorithms import kto
from rlhf_pipeline.trainers.models.load import load_causal_lm
from rlhf_pipeline.trainers.rewards.metrics import sequence_logprobs
from tests.helpers import FAST, trainable, unchanged, write_data_dir

CONFIG = dict(FAST, max_steps=8, per_device_train_batch_size=8)


def kto_from_base(tmp_path, data_dir, untrained_sft):
    """Train KTO from the untrained small model; check that every trainable tensor moved; return (metrics, logged,
    before, after)."""
    policy, tokenizer = load_causal_lm(untrained_sft)
    weights_before = trainable(policy)
    logged: list[dict[str, float]] = []
    metrics = kto.train(
        kto.KtoConfig(**CONFIG),
        untrained_sft,
        data_dir,
        tmp_path / "out",
        tmp_path / "work",
        log_metrics=lambda values, step: logged.append(values),
    )
    trained, _ = load_causal_lm(tmp_path / "out" / "model")
    assert unchanged(weights_before, trained) == []
    return metrics, logged, (policy, tokenizer), (trained, tokenizer)


def gain(before, after, prompts, completions) -> list[float]:
    """log pi_after(completion) - log pi_before(completion), per row: the implied reward / beta."""
    return [
        a - b
        for a, b in zip(
            sequence_logprobs(*after, prompts, completions), sequence_logprobs(*before, prompts, completions)
        )
    ]


def mean(values) -> float:
    return sum(values) / len(values)


def test_kto_trains_every_tensor_on_paired_rows(tmp_path, untrained_sft):
    data = write_data_dir(tmp_path / "data")
    metrics, logged, before, after = kto_from_base(tmp_path, data, untrained_sft)
    keys = set(metrics) | {key for values in logged for key in values}
    assert {"kto/train/loss", "kto/train/kl", "kto/train/rewards_chosen", "kto/train/rewards_rejected"} <= keys
    assert [key for key in keys if not key.startswith("kto/train/")] == []
    # Chosen answers gained log-probability relative to rejected ones (0.28-0.47 nats over seeds 0-5).
    pairs = Dataset.from_parquet(str(data / "datasets" / "preference.parquet"))
    chosen, rejected = (gain(before, after, pairs["prompt"], pairs[column]) for column in ("chosen", "rejected"))
    assert mean(chosen) - mean(rejected) > 0.1


def test_kto_trains_on_unpaired_rows(tmp_path, untrained_sft):
    data = tmp_path / "data"
    write_data_dir(data)
    # Unbalanced, as real thumbs-up/down data is: 48 desirable, 16 undesirable rows.
    pairs = Dataset.from_parquet(str(data / "datasets" / "preference.parquet"))
    rows = [{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in pairs.select(range(48))]
    rows += [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in pairs.select(range(48, 64))]
    Dataset.from_list(rows).to_parquet(str(data / "datasets" / "preference.parquet"))
    metrics, _, before, after = kto_from_base(tmp_path, data, untrained_sft)
    assert {"kto/train/rewards_chosen", "kto/train/rewards_rejected"} <= set(metrics)
    desirable, undesirable = rows[:48], rows[48:]
    up = gain(before, after, [r["prompt"] for r in desirable], [r["completion"] for r in desirable])
    down = gain(before, after, [r["prompt"] for r in undesirable], [r["completion"] for r in undesirable])
    assert mean(up) - mean(down) > 0.1


def test_config_checks_show_the_numbers():
    with pytest.raises(ValidationError, match=r"per_device_train_batch_size=1 with loss_type='kto'.*at least 2"):
        kto.KtoConfig(per_device_train_batch_size=1)
    with pytest.raises(ValidationError, match=r"train_sampling_strategy='random' with loss_type='kto'"):
        kto.KtoConfig(trl_overrides={"train_sampling_strategy": "random"})
    # APO-zero has no KL term: one row per batch is allowed there.
    assert kto.KtoConfig(per_device_train_batch_size=1, loss_type="apo_zero_unpaired").per_device_train_batch_size == 1
    with pytest.raises(ValidationError):
        kto.KtoConfig(loss_type="sigmoid")
    with pytest.raises(ValidationError):
        kto.KtoConfig(desirable_weight=0)


def test_every_field_is_described():
    assert [name for name, field in kto.KtoConfig.model_fields.items() if not field.description] == []
