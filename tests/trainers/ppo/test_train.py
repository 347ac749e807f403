import json
import math
import subprocess
import sys

import pytest
from pydantic import ValidationError
from transformers import AutoModelForSequenceClassification

from rlhf_pipeline.trainers.algorithms.loop import COMPLETE
from rlhf_pipeline.trainers.config import LoraConfig
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import load_causal_lm, save_model
from rlhf_pipeline.trainers.models.text import prompt_ids as text_prompt_ids
from rlhf_pipeline.trainers.ppo import train as ppo
from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig, RewardScorer
from tests.helpers import SMALL_MODEL, trainable, unchanged, write_data_dir

EXACT_MATCH = RewardsConfig(
    reward_model_weight=0, functions=[RewardFunctionSpec(path="rlhf_pipeline.trainers.rewards.sort_task:exact_match")]
)
# 8 prompts per update in 2 mini-batches of 4; 16 episodes = 2 updates.
FAST = dict(
    rollout_batch_size=8,
    num_mini_batches=2,
    num_ppo_epochs=2,
    total_episodes=16,
    response_length=6,
    learning_rate=1e-3,
    temperature=1.0,
    logging_steps=1,
    num_threads=1,
)


def short_reward(prompts, completions, **_):
    """A broken reward function: one score too few."""
    return [0.0] * (len(completions) - 1)


def test_config_checks_batch_arithmetic():
    with pytest.raises(ValidationError, match=r"rollout_batch_size=64 must be divisible by num_mini_batches=3"):
        ppo.PpoConfig(rollout_batch_size=64, num_mini_batches=3)
    with pytest.raises(
        ValidationError, match=r"total_episodes=10 is less than one rollout batch \(rollout_batch_size=64\)"
    ):
        ppo.PpoConfig(total_episodes=10)
    assert ppo.PpoConfig(total_episodes=1000, rollout_batch_size=64).num_updates(5000) == 15
    assert ppo.PpoConfig(rollout_batch_size=64).num_updates(2000) == 31  # None: one pass over the prompts


def test_config_stop_token_and_eos_penalty():
    with pytest.raises(ValidationError, match=r"stop_token='eos' and stop_token_id=3 exclude each other"):
        ppo.PpoConfig(stop_token="eos", stop_token_id=3)
    reward_model, functions = RewardsConfig(reward_model_weight=1.0), EXACT_MATCH
    assert ppo.PpoConfig().eos_penalty(reward_model) == 1.0  # a reward model scores cut-off text as finished
    assert ppo.PpoConfig().eos_penalty(functions) == 0.0
    assert ppo.PpoConfig(missing_eos_penalty=0).eos_penalty(reward_model) == 0.0  # given values win
    assert ppo.PpoConfig(missing_eos_penalty=0.5).eos_penalty(functions) == 0.5


def test_sample_tables_are_spaced_as_trl_spaced_them():
    assert ppo.PpoConfig().sample_every(80) == 8  # 10 tables: updates 1, 9, 17, ...
    assert ppo.PpoConfig(num_sample_generations=2).sample_every(4) == 2  # updates 1 and 3
    assert ppo.PpoConfig().sample_every(4) == 1  # more tables than updates: every update
    assert ppo.PpoConfig(num_sample_generations=0).sample_every(80) is None


def test_import_is_cheap():
    code = (
        "import sys, rlhf_pipeline.trainers.ppo.train; assert 'torch' not in sys.modules and 'transformers' not in "
        "sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- training ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small SFT model, a reward model (seq-cls with the same backbone) and the bundled data, cut short."""
    root = tmp_path_factory.mktemp("ppo")
    policy, tokenizer = load_base_model(SMALL_MODEL)
    save_model(policy, tokenizer, root / "sft")
    reward_model = AutoModelForSequenceClassification.from_pretrained(str(root / "sft"), num_labels=1)
    reward_model.config.pad_token_id = tokenizer.pad_token_id
    save_model(reward_model, tokenizer, root / "rm")
    return {
        "sft": root / "sft",
        "rm": root / "rm",
        "data": write_data_dir(root / "data", rows=32),
        "weights": trainable(policy),
        "value_weights": trainable(reward_model),
        "vocab": len(tokenizer),
    }


def train_on_exact_match(config: ppo.PpoConfig, tiny: dict, folder, log_metrics=None) -> dict[str, float]:
    """PPO from the tiny sft model on exact match alone (no reward model), into `folder`/out and `folder`/work."""
    return ppo.train(config, EXACT_MATCH, tiny["sft"], None, tiny["data"], folder / "out", folder / "work", log_metrics)


def test_training_with_reward_functions_only(tiny, tmp_path):
    logged: list[tuple[int, dict]] = []
    metrics = train_on_exact_match(
        ppo.PpoConfig(**FAST), tiny, tmp_path, lambda values, step: logged.append((step, values))
    )
    trained, _ = load_causal_lm(tmp_path / "out" / "model")
    assert unchanged(tiny["weights"], trained) == []
    assert [step for step, _ in logged] == [1, 2]
    for name in (
        "reward",
        "kl",
        "entropy",
        "policy_loss",
        "value_loss",
        "clipfrac",
        "approx_kl",
        "response_length",
        "learning_rate",
        "reward_exact_match",
        "non_score_reward",
        "explained_variance",
        "ratio",
    ):
        assert f"ppo/train/{name}" in metrics, name
    assert all(math.isfinite(v) for _, values in logged for v in values.values())
    for _, values in logged:  # the summed KL penalty per completion
        assert values["ppo/train/non_score_reward"] == pytest.approx(-0.05 * values["ppo/train/kl"])
    assert metrics == logged[-1][1]
    first = logged[0][1]
    # Update 1 rolls out the policy before any step, so it still is the reference: KL exactly 0. Its
    # next-token distribution is near uniform over the 263 tokens: entropy about ln 263 = 5.57 nats.
    assert first["ppo/train/kl"] == 0.0
    assert first["ppo/train/entropy"] == pytest.approx(math.log(tiny["vocab"]), rel=0.01)
    # The 4 optimizer steps of an update (2 epochs x 2 mini-batches) move the policy away from the rollout's:
    # the first step's ratio is exactly 1, the later ones' are not.
    assert first["ppo/train/approx_kl"] > 0
    assert first["ppo/train/ratio"] != 1.0 and first["ppo/train/ratio"] == pytest.approx(1.0, abs=0.5)
    # The value head starts untrained (a fresh head on the SFT model): worse than predicting the mean return.
    assert first["ppo/train/explained_variance"] < 0
    # Linear decay over the 2 updates: lr * (1 - (update - 1) / 2).
    assert [values["ppo/train/learning_rate"] for _, values in logged] == [pytest.approx(1e-3), pytest.approx(5e-4)]
    # One reward function with weight 1 and no EOS penalty: the reward is its score.
    assert metrics["ppo/train/reward"] == pytest.approx(metrics["ppo/train/reward_exact_match"])


def test_training_with_a_reward_model_and_lora(tiny, tmp_path):
    cfg = ppo.PpoConfig(**FAST, lora=LoraConfig(enabled=True, r=4, lora_alpha=8), save_value_model=True)
    metrics = ppo.train(
        cfg,
        RewardsConfig(reward_model_weight=1.0),
        tiny["sft"],
        tiny["rm"],
        tiny["data"],
        tmp_path / "out",
        tmp_path / "work",
    )
    # The only reward, weight 1, less the default missing-EOS penalty of 1.0 (a reward model is among the rewards)
    # for the share of completions that reached no stop token.
    assert metrics["ppo/train/missing_eos"] > 0
    assert metrics["ppo/train/reward"] == pytest.approx(
        metrics["ppo/train/reward_model"] - 1.0 * metrics["ppo/train/missing_eos"]
    )
    trained, _ = load_causal_lm(tmp_path / "out" / "model")  # merged: loads as a plain causal LM
    # peft's "all-linear" adapts every Linear of the blocks but not the output head: once merged, exactly
    # those weights moved, and the frozen embedding, norms and lm_head are bit-identical to the SFT model.
    assert unchanged(tiny["weights"], trained) == sorted(name for name in tiny["weights"] if "_proj." not in name)
    value_model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out" / "value_model"))
    assert value_model.config.num_labels == 1
    # LoRA is on the policy only: the value model trains whole
    assert unchanged(tiny["value_weights"], value_model) == []


def test_resume_continues_the_update_counter(tiny, tmp_path):
    work = tmp_path / "work"
    first: list[int] = []
    ppo.train(
        ppo.PpoConfig(**{**FAST, "save_steps": 1}),
        EXACT_MATCH,
        tiny["sft"],
        None,
        tiny["data"],
        tmp_path / "out",
        work,
        lambda v, s: first.append(s),
    )
    assert first == [1, 2]
    state = json.loads((work / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["update"] == 2 and state["data_index"] == 16
    assert {p.name for p in (work / "checkpoint-2").iterdir()} == {
        "policy.safetensors",
        "value_model.safetensors",
        "optimizer.pt",
        "rng.pt",
        "trainer_state.json",
        COMPLETE,
    }
    (work / "checkpoint-9").mkdir()  # half-written (no trainer_state.json): must be ignored
    second: list[int] = []
    ppo.train(
        ppo.PpoConfig(**{**FAST, "save_steps": 1, "total_episodes": 32}),
        EXACT_MATCH,
        tiny["sft"],
        None,
        tiny["data"],
        tmp_path / "out",
        work,
        lambda v, s: second.append(s),
    )
    assert second == [3, 4]  # 32 episodes / 8 per update = 4 updates in all, 2 of them already done
    assert json.loads((work / "checkpoint-4" / "trainer_state.json").read_text())["data_index"] == 32


def test_resume_after_a_crash_matches_an_unbroken_run(tiny, tmp_path):
    cfg = ppo.PpoConfig(**{**FAST, "total_episodes": 32, "save_steps": 2})

    def crash_at_update_3(values, step):
        if step == 3:
            raise RuntimeError("worker killed")

    with pytest.raises(RuntimeError, match="worker killed"):
        ppo.train(
            cfg, EXACT_MATCH, tiny["sft"], None, tiny["data"], tmp_path / "out", tmp_path / "work", crash_at_update_3
        )
    steps: list[int] = []
    ppo.train(
        cfg,
        EXACT_MATCH,
        tiny["sft"],
        None,
        tiny["data"],
        tmp_path / "out",
        tmp_path / "work",
        lambda v, s: steps.append(s),
    )
    assert steps == [3, 4]
    ppo.train(cfg, EXACT_MATCH, tiny["sft"], None, tiny["data"], tmp_path / "straight", tmp_path / "work-straight")
    # Weights, optimizer, data position and RNG came back from checkpoint-2: the same result as no crash.
    resumed, _ = load_causal_lm(tmp_path / "out" / "model")
    straight, _ = load_causal_lm(tmp_path / "straight" / "model")
    weights = trainable(resumed)
    assert unchanged(weights, straight) == sorted(weights)  # every tensor bit-identical
    assert (tmp_path / "out" / "samples.jsonl").read_text() == (tmp_path / "straight" / "samples.jsonl").read_text()
    assert unchanged(tiny["weights"], straight) == []  # and both did train


def test_a_broken_reward_function_fails_before_training(tiny, tmp_path):
    rewards = RewardsConfig(
        reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.trainers.ppo.test_train:short_reward")]
    )
    logged: list[int] = []
    with pytest.raises(
        ValueError, match=r"'tests.trainers.ppo.test_train:short_reward' returned 3 scores for 4 completions"
    ):
        ppo.train(
            ppo.PpoConfig(**FAST),
            rewards,
            tiny["sft"],
            None,
            tiny["data"],
            tmp_path / "out",
            tmp_path / "work",
            lambda v, s: logged.append(s),
        )
    assert logged == []
    assert not (tmp_path / "work").exists()


def test_k3_penalises_the_same_samples_differently(tiny, tmp_path):
    runs = {}
    for estimator in ("k1", "k3"):
        logged: list[dict] = []
        cfg = ppo.PpoConfig(**FAST, kl_estimator=estimator, num_sample_generations=0)
        ppo.train(
            cfg,
            EXACT_MATCH,
            tiny["sft"],
            None,
            tiny["data"],
            tmp_path / estimator,
            tmp_path / f"work-{estimator}",
            lambda v, s: logged.append(v),
        )
        runs[estimator] = logged
    k1, k3 = runs["k1"], runs["k3"]
    # Update 1 (policy = reference, KL 0 either way) trains both alike, so update 2 samples the same completions,
    # whose KL the two estimators put differently: k3 is positive on every token that moved.
    assert k1[0] == k3[0]
    assert k3[1]["ppo/train/kl"] > 0 and k3[1]["ppo/train/kl"] != pytest.approx(k1[1]["ppo/train/kl"])
    assert k3[1]["ppo/train/non_score_reward"] == pytest.approx(-0.05 * k3[1]["ppo/train/kl"])
    assert unchanged(tiny["weights"], load_causal_lm(tmp_path / "k3" / "model")[0]) == []
    assert not (tmp_path / "k3" / "samples.jsonl").exists()  # num_sample_generations=0: no tables


def test_completions_cut_at_response_length_are_penalised_and_scored_without_eos(tiny, tmp_path, monkeypatch):
    """response_length=2 on an untrained model: no completion ends. The reward model reads prompt + the 2 sampled
    ids (no EOS appended), and the default missing_eos_penalty (1.0: a reward model is among the rewards) lowers
    exactly those scores."""
    scored: list[tuple[list, list]] = []
    original = RewardScorer.__call__

    def spy(scorer, prompts, completions, columns, ids=None, batch_size=64):
        scored.append((prompts, ids))
        return original(scorer, prompts, completions, columns, ids=ids, batch_size=batch_size)

    monkeypatch.setattr(RewardScorer, "__call__", spy)
    cfg = ppo.PpoConfig(**{**FAST, "response_length": 2, "rollout_batch_size": ppo.SAMPLE_ROWS, "num_mini_batches": 1})
    metrics = ppo.train(
        cfg,
        RewardsConfig(reward_model_weight=1.0),
        tiny["sft"],
        tiny["rm"],
        tiny["data"],
        tmp_path / "out",
        tmp_path / "work",
    )
    tokenizer = load_causal_lm(tiny["sft"])[1]
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(scored) == 2 and len(samples) == 2 * ppo.SAMPLE_ROWS  # every rollout of both updates is in the tables
    for (prompts, ids), rows in zip(scored, (samples[: ppo.SAMPLE_ROWS], samples[ppo.SAMPLE_ROWS :])):
        for prompt, row_ids, row in zip(prompts, ids, rows):
            prompt_ids = text_prompt_ids(tokenizer, prompt)
            assert row_ids[: len(prompt_ids)] == prompt_ids and len(row_ids) == len(prompt_ids) + 2
            assert tokenizer.eos_token_id not in row_ids[len(prompt_ids) :]
            assert not row["ended"] and row["score"] == pytest.approx(row["reward_model"] - 1.0, abs=1e-5)
    assert metrics["ppo/train/missing_eos"] == 1.0
    assert metrics["ppo/train/reward"] == pytest.approx(metrics["ppo/train/reward_model"] - 1.0)


def test_samples_jsonl_every_few_updates_and_once_after_a_resume(tiny, tmp_path):
    # 4 updates: tables at 1 and 3
    cfg = ppo.PpoConfig(**{**FAST, "total_episodes": 32, "save_steps": 2, "num_sample_generations": 2})

    def crash_at_update_4(values, step):
        if step == 4:
            raise RuntimeError("worker killed")

    # The crash comes after update 3's table and before checkpoint-4: the resumed run redoes update 3 and its table.
    with pytest.raises(RuntimeError, match="worker killed"):
        ppo.train(
            cfg, EXACT_MATCH, tiny["sft"], None, tiny["data"], tmp_path / "out", tmp_path / "work", crash_at_update_4
        )
    ppo.train(cfg, EXACT_MATCH, tiny["sft"], None, tiny["data"], tmp_path / "out", tmp_path / "work")
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [row["update"] for row in rows] == [1] * 8 + [3] * 8
    assert set(rows[0]) == {"update", "prompt", "completion", "ended", "score", "reward_exact_match"}
    assert all(row["score"] == row["reward_exact_match"] for row in rows)  # reward functions only: no default penalty


def test_a_sigterm_mid_ppo_writes_a_checkpoint_publishes_nothing_and_the_next_attempt_resumes_from_it(tiny, tmp_path):
    from rlhf_pipeline.trainers.config import CallbackSpec
    from rlhf_pipeline.trainers.runtime.stopping import TERMINATING, Terminated

    four_updates = {**FAST, "total_episodes": 32, "save_steps": 1000}  # no periodic checkpoint: only the signal's
    terminate = CallbackSpec(path="tests.user_code:TerminateAt", kwargs={"step": 2})
    signalled = ppo.PpoConfig(**four_updates, callbacks=[terminate])
    logged: list[int] = []
    try:
        with pytest.raises(Terminated, match="ppo: stopped by SIGTERM after update 2; the next attempt resumes"):
            train_on_exact_match(signalled, tiny, tmp_path)
    finally:
        TERMINATING.clear()  # this process goes on: the next attempt is the same config, here
    assert (tmp_path / "work" / "checkpoint-2" / COMPLETE).is_file() and not (tmp_path / "out" / "model").exists()
    train_on_exact_match(ppo.PpoConfig(**four_updates), tiny, tmp_path, lambda values, step: logged.append(step))
    assert logged == [3, 4] and (tmp_path / "out" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rollout_logprobs_from_generation_spare_a_forward_pass_and_keep_the_first_ratio_at_1(
    tiny, tmp_path, monkeypatch, lora
):
    """`rollout_logprobs`: the old log-probs and entropy come from generation's scores, so a rollout runs one log-prob
    forward (the reference's) instead of two; one update of one mini-batch logs that mini-batch's ratio, taken before
    any step: within 1e-3 of 1 (cached decoding rounds otherwise than one forward pass). Sampling itself is unchanged:
    the same seed draws the same completions, so the reward is the same, and so, within rounding, is the entropy."""
    forwards: list[int] = []
    counted = ppo.response_logprobs

    def counting(model, inputs, *args, **kwargs):
        forwards.append(len(inputs["input_ids"]))
        return counted(model, inputs, *args, **kwargs)

    monkeypatch.setattr(ppo, "response_logprobs", counting)
    one_step = {**FAST, "num_mini_batches": 1, "num_ppo_epochs": 1, "total_episodes": 8}
    adapters = LoraConfig(enabled=lora, r=4, lora_alpha=8)
    runs = {}
    for from_generation in (False, True):
        forwards.clear()
        logged: list[dict] = []
        cfg = ppo.PpoConfig(**one_step, lora=adapters, rollout_logprobs=from_generation)
        train_on_exact_match(cfg, tiny, tmp_path / str(from_generation), lambda v, s: logged.append(v))
        # Forward passes of 8 rows each: the rollout's policy (without the option) and reference, then the step's.
        assert forwards == [8] * (2 if from_generation else 3), from_generation
        runs[from_generation] = logged[0]
    exact, generated = runs[False], runs[True]
    assert exact["ppo/train/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert generated["ppo/train/ratio"] == pytest.approx(1.0, abs=1e-3)
    assert generated["ppo/train/reward"] == exact["ppo/train/reward"]
    assert generated["ppo/train/response_length"] == exact["ppo/train/response_length"]
    assert generated["ppo/train/entropy"] == pytest.approx(exact["ppo/train/entropy"], abs=1e-4)
    assert generated["ppo/train/kl"] == pytest.approx(0.0, abs=1e-4)  # the reference is the policy before any step
