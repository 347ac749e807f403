"""GRPO and RLOO (trainers/algorithms/online.py through trainers/algorithms/grpo.py and trainers/algorithms/rloo.py)."""

import pytest
from pydantic import ValidationError
from transformers import AutoModelForSequenceClassification

from rlhf_pipeline.trainers.algorithms import grpo, rloo
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import load_causal_lm, save_model
from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig
from tests import helpers
from tests.helpers import FALLING, FAST, SMALL_MODEL, trainable, unchanged, write_data_dir

ONLINE = {**FAST, "per_device_train_batch_size": 8, "max_steps": 2, "max_completion_length": 6, "num_generations": 4}
TIME_PARTS = ("generation", "reward", "forward_backward", "optimizer")
VERIFIER = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")])


def trained(module, cfg, tmp_path, sft_dir, log, **kwargs) -> dict[str, float]:
    """`module.train` of `cfg` with the length reward on 16 prompts from `sft_dir`, into tmp_path's out/ and work/."""
    data = write_data_dir(tmp_path / "data", rows=16)
    return module.train(cfg, VERIFIER, sft_dir, None, data, tmp_path / "out", tmp_path / "work", log, **kwargs)


@pytest.fixture
def sft_dir(tmp_path):
    policy, tokenizer = load_base_model(SMALL_MODEL)
    return save_model(policy, tokenizer, tmp_path / "sft")


@pytest.mark.parametrize("module,config", [(grpo, grpo.GrpoConfig), (rloo, rloo.RlooConfig)], ids=["grpo", "rloo"])
def test_online_stage_updates_the_policy_with_reward_functions(tmp_path, sft_dir, module, config):
    data = write_data_dir(tmp_path / "data", rows=16)
    before = trainable(load_causal_lm(sft_dir)[0])
    logged: list[dict] = []
    metrics = module.train(
        config(**ONLINE),
        VERIFIER,
        sft_dir,
        None,
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append(values),
    )
    assert unchanged(before, load_causal_lm(tmp_path / "out" / "model")[0]) == []
    stage = module.__name__.split(".")[-1]
    # beta > 0: the KL to the reference is reported; 0 at step 1, whose rollouts come from the policy before
    # its first update (still the reference), and positive once it has moved.
    kl = [values[f"{stage}/train/kl"] for values in logged if f"{stage}/train/kl" in values]
    assert kl[0] == 0.0 and kl[1] > 0 and len(kl) == 2
    # One reward function with weight 1: the reward is that function's mean score.
    assert metrics[f"{stage}/train/reward"] == pytest.approx(metrics[f"{stage}/train/rewards_length_reward_mean"])


def test_grpo_scores_with_the_reward_model_and_functions_together(tmp_path, sft_dir):
    data = write_data_dir(tmp_path / "data", rows=16)
    _, tokenizer = load_causal_lm(sft_dir)
    head = AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1)
    head.config.pad_token_id = tokenizer.pad_token_id
    save_model(head, tokenizer, tmp_path / "rm")
    rewards = VERIFIER.model_copy(update={"reward_model_weight": 0.5})
    metrics = grpo.train(
        grpo.GrpoConfig(**ONLINE), rewards, sft_dir, tmp_path / "rm", data, tmp_path / "out", tmp_path / "work"
    )
    components = {k for k in metrics if k.startswith("grpo/train/rewards_")}
    # One mean and std per reward: the function, and the reward model (TRL names it after its folder, `rm`).
    assert components == {
        f"grpo/train/rewards_{name}_{stat}" for name in ("length_reward", "rm") for stat in ("mean", "std")
    }
    # The reward trained on is the weighted sum, 1.0 x the function + 0.5 x the reward model.
    expected = metrics["grpo/train/rewards_length_reward_mean"] + 0.5 * metrics["grpo/train/rewards_rm_mean"]
    assert metrics["grpo/train/reward"] == pytest.approx(expected)


def test_group_must_divide_the_generation_batch():
    with pytest.raises(ValidationError, match=r"num_generations=3 must divide .* = 8 \* 1 = 8"):
        grpo.GrpoConfig(per_device_train_batch_size=8, num_generations=3)


def test_broken_reward_function_fails_before_training(tmp_path, sft_dir, monkeypatch):
    data = write_data_dir(tmp_path / "data", rows=16)
    (tmp_path / "broken_reward.py").write_text(
        "def score(prompts, completions, **columns):\n    return columns['gold']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="broken_reward:score")])
    with pytest.raises(ValueError, match="'broken_reward:score' raised on a sample of 4 rows: KeyError"):
        rloo.train(rloo.RlooConfig(**ONLINE), bad, sft_dir, None, data, tmp_path / "out", tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_vllm_rollouts_need_vllm_and_a_gpu_and_say_so_before_any_weights_load(tmp_path, sft_dir):
    import importlib.util

    import torch

    assert importlib.util.find_spec("vllm") is None  # this machine: the parameters name the extra to install
    with pytest.raises(
        ValidationError, match=r"use_vllm=true needs vLLM, which is not installed: pip install 'rlhf-pipeline\[vllm\]'"
    ):
        grpo.GrpoConfig(use_vllm=True)
    if not torch.cuda.is_available():  # with vLLM installed on a CPU machine, the stage names the missing device
        cfg = rloo.RlooConfig.model_construct(**{**dict(rloo.RlooConfig(**ONLINE)), "use_vllm": True})
        rewards = RewardsConfig(
            reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")]
        )
        with pytest.raises(
            ValueError, match="use_vllm=true: vLLM generates on a CUDA GPU, and this machine trains on cpu"
        ):
            rloo.train(
                cfg,
                rewards,
                sft_dir,
                None,
                write_data_dir(tmp_path / "data", rows=16),
                tmp_path / "out",
                tmp_path / "work",
            )
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module,config", [(grpo, grpo.GrpoConfig), (rloo, rloo.RlooConfig)], ids=["grpo", "rloo"])
def test_online_stages_probe_the_held_out_prompts_with_an_ensemble_and_publish_the_best_probe(
    tmp_path, sft_dir, module, config
):
    import json

    import torch

    from rlhf_pipeline.trainers.algorithms import rm
    from rlhf_pipeline.trainers.rewards.probes import CURVES

    data = write_data_dir(tmp_path / "data", rows=16)
    rm.train(
        rm.RewardModelConfig(max_steps=2, ensemble_size=2, **FAST), sft_dir, data, tmp_path / "rm", tmp_path / "rm-work"
    )
    stage = module.__name__.split(".")[-1]
    logged: list[tuple[int, dict]] = []
    cfg = config(**{**ONLINE, "max_steps": 4, "learning_rate": 1e-2}, eval_steps=2, eval_prompts=8)
    rewards = RewardsConfig(reward_model_aggregate="min")
    metrics = module.train(
        cfg,
        rewards,
        sft_dir,
        tmp_path / "rm" / "model",
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    # The reward is the ensemble's minimum, logged under the function's name (`reward_model`).
    assert f"{stage}/train/rewards_reward_model_mean" in metrics
    probes = [(step, v) for step, v in logged if f"{stage}/heldout/kl" in v]
    assert [step for step, _ in probes] == [2, 4]
    for _, values in probes:
        for name in ("kl", "sqrt_kl", "exact_match", "proxy_reward", "disagreement", "score"):
            assert f"{stage}/heldout/{name}" in values
        assert values[f"{stage}/heldout/disagreement"] > 0  # two members, two seeds, two resamples
    assert probes[-1][1][f"{stage}/heldout/kl"] != 0  # the policy moved away from SFT
    curves = [json.loads(line) for line in (tmp_path / "out" / CURVES).read_text().splitlines()]
    best = max(curves, key=lambda c: c["score"])
    outcome = json.loads((tmp_path / "out" / "training.json").read_text())
    assert outcome["kept_step"] == best["step"] and metrics[f"{stage}/heldout/kept_step"] == best["step"]
    # The published policy holds the best probe's weights (put back when a later step was worse).
    from safetensors.torch import load_file

    kept = load_file(tmp_path / "work" / "best-policy" / "policy.safetensors")
    published = load_causal_lm(tmp_path / "out" / "model")[0].state_dict()
    assert kept and all(torch.equal(published[name], tensor) for name, tensor in kept.items() if name in published)
    assert sum(name in published for name in kept) == len(published)


def test_keep_best_chooses_by_the_held_out_gold_metric_when_the_training_reward_rises_and_it_falls(
    tmp_path, sft_dir, monkeypatch
):
    """The training reward (answer length) rises while eval's gold metric falls after the second probe: the probes
    score the gold metric, keep_best publishes the probe that was best on it, which is not the last, and the reward
    never chose. (The gold metric falls by its calls, not by the answers: a tiny model's greedy answers over 8 steps
    decided the old version of this test by the seed's luck.)"""
    import json

    from rlhf_pipeline.trainers.rewards.mix import GoldMetric
    from rlhf_pipeline.trainers.rewards.probes import CURVES

    monkeypatch.setattr(helpers, "_gold_calls", [0])
    logged: list[tuple[int, dict]] = []
    cfg = grpo.GrpoConfig(**{**ONLINE, "max_steps": 8, "learning_rate": 1e-2}, eval_steps=2, eval_prompts=8)
    metrics = trained(
        grpo,
        cfg.model_copy(update={"keep_best": True}),
        tmp_path,
        sft_dir,
        lambda values, step: logged.append((step, values)),
        gold=GoldMetric(function=RewardFunctionSpec(path="tests.helpers:falling_gold")),
    )
    rewards = [v["grpo/train/reward"] for _, v in logged if "grpo/train/reward" in v]
    assert rewards[-1] > rewards[0], rewards  # the training reward rose
    curves = [json.loads(line) for line in (tmp_path / "out" / CURVES).read_text().splitlines()]
    assert [c["step"] for c in curves] == [2, 4, 6, 8]
    assert all(c["score"] == c["gold"] for c in curves)  # the gold metric scores the probes, not exact match
    best = max(curves, key=lambda c: c["gold"])
    assert [c["gold"] for c in curves] == FALLING[1:5] and best["step"] == 4  # ... and it fell
    outcome = json.loads((tmp_path / "out" / "training.json").read_text())
    assert outcome["kept_step"] == best["step"] != 8 and metrics["grpo/heldout/kept_step"] == best["step"]


@pytest.mark.parametrize("module,config", [(grpo, grpo.GrpoConfig), (rloo, rloo.RlooConfig)], ids=["grpo", "rloo"])
def test_rollouts_are_decoded_and_grpo_logs_how_far_the_trainers_log_probs_lie_from_the_sampler(
    tmp_path, sft_dir, monkeypatch, module, config
):
    from rlhf_pipeline.trainers.models import decode

    decoded: list[int] = []
    real = decode.decode
    monkeypatch.setattr(
        decode, "decode", lambda model, prompts, *a, **k: decoded.append(len(prompts)) or real(model, prompts, *a, **k)
    )
    logged: list[dict] = []
    stage = module.__name__.rsplit(".", 1)[-1]
    trained(
        module, config(**{**ONLINE, "temperature": 0.7}), tmp_path, sft_dir, lambda values, step: logged.append(values)
    )
    assert decoded == [ONLINE["per_device_train_batch_size"]] * ONLINE["max_steps"]  # every rollout, every completion
    # where each step's time went: every part measured, at each logged step
    split = [
        {part: v[f"{stage}/train/time_{part}"] for part in TIME_PARTS}
        for v in logged
        if f"{stage}/train/time_generation" in v
    ]
    assert len(split) == ONLINE["max_steps"] and all(s["generation"] > 0 and s["forward_backward"] > 0 for s in split)
    assert all(s["reward"] > 0 and s["optimizer"] > 0 for s in split)
    differences = [
        (
            v[f"{stage}/train/sampling_sampling_logp_difference_mean"],
            v[f"{stage}/train/sampling_sampling_logp_difference_max"],
        )
        for v in logged
        if f"{stage}/train/sampling_sampling_logp_difference_mean" in v
    ]
    if stage == "rloo":  # TRL's RLOO takes no log-probs from its sampler
        assert not differences
        return
    # the same float32 weights on both sides: the tempered log-probs agree to float32's rounding
    assert len(differences) == ONLINE["max_steps"] and all(0 <= mean <= top < 1e-4 for mean, top in differences)
