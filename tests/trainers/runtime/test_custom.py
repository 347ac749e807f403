"""The user's own training code in the stages: an optimizer factory, callbacks, evaluation during training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from rlhf_pipeline.trainers.algorithms import dpo, sft
from rlhf_pipeline.trainers.algorithms.loop import OUTCOME
from rlhf_pipeline.trainers.config import CallbackSpec
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import load_causal_lm, save_model
from rlhf_pipeline.trainers.ppo import train as ppo
from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig
from tests.helpers import FAST, SMALL_MODEL, trainable, unchanged, write_data_dir

ROOT = Path(__file__).resolve().parents[3]


def steps_logged(logged: list[tuple[int, dict]], name: str) -> list[int]:
    return [step for step, values in logged if name in values]


def test_an_sgd_factory_trains_sft_and_a_killed_stage_resumes_with_its_state(tmp_path):
    data = write_data_dir(tmp_path / "data")
    config = sft.SftConfig(
        max_steps=4, optimizer_factory="tests.user_code:sgd", **{**FAST, "learning_rate": 0.05, "save_steps": 2}
    )
    killed = config.model_copy(
        update={"callbacks": [CallbackSpec(path="tests.user_code:KillAtStep", kwargs={"step": 3})]}
    )
    # The first attempt dies by SIGKILL at step 3, after checkpoint-2, in a process of its own.
    script = (
        "import sys, json; from pathlib import Path; from rlhf_pipeline.trainers.algorithms import sft\n"
        "from tests.helpers import SMALL_MODEL\n"
        "cfg = sft.SftConfig.model_validate_json(sys.argv[1])\n"
        "sft.train(cfg, SMALL_MODEL, Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))\n"
    )
    args = [killed.model_dump_json(), str(data), str(tmp_path / "first"), str(tmp_path / "work")]
    died = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert died.returncode == -9, died.stderr[-2000:]
    checkpoint = tmp_path / "work" / "checkpoint-2"
    momentum = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    # SGD's, not AdamW's
    assert "momentum" in momentum["param_groups"][0] and "betas" not in momentum["param_groups"][0]
    assert all("momentum_buffer" in state for state in momentum["state"].values())
    # The retry resumes from checkpoint-2 with SGD's momentum restored, and trains steps 3 and 4 only.
    logged: list[tuple[int, dict]] = []
    sft.train(
        config,
        SMALL_MODEL,
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    assert steps_logged(logged, "sft/train/loss") == [3, 4]
    final = torch.load(tmp_path / "work" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert final["param_groups"][0]["momentum"] == 0.9
    assert unchanged(trainable(load_base_model(SMALL_MODEL)[0]), load_causal_lm(tmp_path / "out" / "model")[0]) == []
    assert json.loads((tmp_path / "out" / OUTCOME).read_text()) == {
        "global_step": 4,
        "max_steps": 4,
        "stopped_early": False,
    }


def test_an_optimizer_factory_that_trains_nothing_fails_naming_it(tmp_path):
    data = write_data_dir(tmp_path / "data")
    config = sft.SftConfig(max_steps=2, optimizer_factory="tests.user_code:frozen_only", **FAST)
    with pytest.raises(
        ValueError, match=r"'tests.user_code:frozen_only' returned an optimizer that holds none of the model's"
    ):
        sft.train(config, SMALL_MODEL, data, tmp_path / "out", tmp_path / "work")


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("custom")
    policy, tokenizer = load_base_model(SMALL_MODEL)
    return save_model(policy, tokenizer, root / "sft")


def test_one_callback_sees_the_same_hook_counts_in_sft_and_ppo(tmp_path, sft_dir):
    data = write_data_dir(tmp_path / "data", rows=32)
    counts = {name: tmp_path / f"{name}.json" for name in ("sft", "ppo")}
    hooks = {
        name: [CallbackSpec(path="tests.user_code:CountHooks", kwargs={"out": str(path)})]
        for name, path in counts.items()
    }
    # 4 steps (sft) or updates (ppo), logging and saving every 2.
    sft.train(
        sft.SftConfig(max_steps=4, callbacks=hooks["sft"], **{**FAST, "logging_steps": 2, "save_steps": 2}),
        SMALL_MODEL,
        data,
        tmp_path / "sft",
        tmp_path / "sft-work",
    )
    rewards = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")])
    ppo_cfg = ppo.PpoConfig(
        rollout_batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=1,
        total_episodes=32,
        response_length=4,
        logging_steps=2,
        save_steps=2,
        num_threads=1,
        callbacks=hooks["ppo"],
    )
    ppo.train(ppo_cfg, rewards, sft_dir, None, data, tmp_path / "ppo", tmp_path / "ppo-work")
    seen = {name: json.loads(path.read_text()) for name, path in counts.items()}
    # Each step ends once, logs at steps 2 and 4 plus the closing summary, checkpoints at 2 and 4.
    assert seen["sft"] == {"on_train_begin": 1, "on_step_end": 4, "on_log": 3, "on_save": 2, "on_train_end": 1}
    assert seen["ppo"] == seen["sft"]


def test_a_callback_stops_ppo_early_and_its_factory_scheduler_is_stepped_per_update(tmp_path, sft_dir):
    data = write_data_dir(tmp_path / "data", rows=32)
    rewards = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")])
    cfg = ppo.PpoConfig(
        rollout_batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=1,
        total_episodes=32,
        response_length=4,
        logging_steps=1,
        save_steps=1,
        num_threads=1,
        learning_rate=0.1,
        optimizer_factory="tests.user_code:sgd_with_step_decay",
        callbacks=[CallbackSpec(path="tests.user_code:StopAtStep", kwargs={"step": 3})],
    )
    logged: list[tuple[int, dict]] = []
    ppo.train(
        cfg,
        rewards,
        sft_dir,
        None,
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    assert steps_logged(logged, "ppo/train/reward") == [1, 2, 3]  # of 4 updates
    assert [values["ppo/train/learning_rate"] for _, values in logged] == pytest.approx([0.1, 0.05, 0.025])
    assert json.loads((tmp_path / "out" / OUTCOME).read_text()) == {
        "global_step": 3,
        "max_steps": 4,
        "stopped_early": True,
    }
    saved = torch.load(tmp_path / "work" / "checkpoint-3" / "scheduler.pt", weights_only=True)
    assert (
        saved["last_epoch"] == 3
        and "momentum"
        in torch.load(tmp_path / "work" / "checkpoint-3" / "optimizer.pt", weights_only=True)["param_groups"][0]
    )


def test_an_early_stopping_callback_ends_dpo_before_max_steps(tmp_path, sft_dir):
    data = write_data_dir(tmp_path / "data", rows=32)
    cfg = dpo.DpoConfig(
        max_steps=10, callbacks=[CallbackSpec(path="tests.user_code:StopAtStep", kwargs={"step": 3})], **FAST
    )
    logged: list[tuple[int, dict]] = []
    dpo.train(
        cfg, sft_dir, data, tmp_path / "out", tmp_path / "work", lambda values, step: logged.append((step, values))
    )
    assert steps_logged(logged, "dpo/train/loss") == [1, 2, 3]
    assert json.loads((tmp_path / "out" / OUTCOME).read_text()) == {
        "global_step": 3,
        "max_steps": 10,
        "stopped_early": True,
    }
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()


def test_sft_evaluates_during_training_and_publishes_the_best_checkpoint(tmp_path):
    data = write_data_dir(tmp_path / "data")
    cfg = sft.SftConfig(
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        eval_split=0.25,
        compute_metrics="tests.user_code:token_accuracy",
        # The *worst* eval loss is best here: the published checkpoint is then not simply the last one.
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
        **{**FAST, "save_steps": 2},
    )
    logged: list[tuple[int, dict]] = []
    sft.train(
        cfg, SMALL_MODEL, data, tmp_path / "out", tmp_path / "work", lambda values, step: logged.append((step, values))
    )
    curve = {step: values["sft/eval/loss"] for step, values in logged if "sft/eval/loss" in values}
    assert sorted(curve)[:4] == [2, 4, 6, 8] and len(curve) >= 3
    assert steps_logged(logged, "sft/eval/token_accuracy")[:4] == [2, 4, 6, 8]
    worst = max((s for s in curve if s in (2, 4, 6, 8)), key=lambda s: curve[s])
    outcome = json.loads((tmp_path / "out" / OUTCOME).read_text())
    assert outcome["best_checkpoint"] == f"checkpoint-{worst}" and outcome["best_metric"] == pytest.approx(curve[worst])
    assert worst != 8  # the eval loss fell while training: the pick is an earlier checkpoint
    best = load_file(tmp_path / "work" / f"checkpoint-{worst}" / "model.safetensors")
    # The published weights are that checkpoint's
    assert unchanged(best, load_causal_lm(tmp_path / "out" / "model")[0]) == sorted(best)


def test_misspelt_or_misshapen_user_code_fails_with_the_parameters(tmp_path, monkeypatch):
    with pytest.raises(
        ValidationError, match=r"optimizer_factory 'tests.user_code:sgdd': tests.user_code has no 'sgdd'"
    ):
        sft.SftConfig(optimizer_factory="tests.user_code:sgdd")
    with pytest.raises(
        ValidationError,
        match=r"optimizer_factory 'tests.user_code:token_accuracy' has the signature token_accuracy\(eval_prediction\)",
    ):
        sft.SftConfig(optimizer_factory="tests.user_code:token_accuracy")
    with pytest.raises(
        ValidationError, match=r"callback 'tests.user_code:sgd' is not a subclass of transformers.TrainerCallback"
    ):
        ppo.PpoConfig(callbacks=[CallbackSpec(path="tests.user_code:sgd")])
    with pytest.raises(
        ValidationError, match=r"callback 'tests.user_code:StopAtStep' cannot be built with kwargs \{'steps': 3\}"
    ):
        CallbackSpec(path="tests.user_code:StopAtStep", kwargs={"steps": 3})
    with pytest.raises(
        ValidationError, match=r"compute_metrics 'no_such_lab.metrics:f': module 'no_such_lab.metrics' does not import"
    ):
        dpo.DpoConfig(eval_strategy="steps", compute_metrics="no_such_lab.metrics:f")
    with pytest.raises(
        ValidationError, match=r"compute_metrics only apply while evaluating: set eval_strategy='steps'"
    ):
        sft.SftConfig(compute_metrics="tests.user_code:token_accuracy")
    with pytest.raises(ValidationError, match=r"save_steps=5: it must be a multiple of eval_steps=2"):
        sft.SftConfig(eval_strategy="steps", eval_steps=2, save_steps=5, load_best_model_at_end=True)


def test_a_quantized_reference_needs_bitsandbytes_and_a_gpu(tmp_path, sft_dir):
    import importlib.util

    assert importlib.util.find_spec("bitsandbytes") is None  # this machine: the params check names the package
    with pytest.raises(ValidationError, match=r"ref_model_quantization='8bit' needs bitsandbytes \(and a CUDA GPU\)"):
        dpo.DpoConfig(ref_model_quantization="8bit")
    with pytest.raises(ValidationError, match=r"ref_model_quantization='4bit' with lora"):
        dpo.DpoConfig(ref_model_quantization="4bit", lora={"enabled": True})
    # With the package present (a CPU-only install of it), the stage names the missing device before any weights load.
    cfg = dpo.DpoConfig.model_construct(
        **{**dict(dpo.DpoConfig(max_steps=2, **FAST)), "ref_model_quantization": "8bit"}
    )
    with pytest.raises(
        ValueError,
        match=r"ref_model_quantization='8bit': bitsandbytes quantizes on a CUDA GPU, and this machine trains on cpu",
    ):
        dpo.train(cfg, sft_dir, write_data_dir(tmp_path / "data", rows=8), tmp_path / "out", tmp_path / "work")
    assert not (tmp_path / "out").exists()


def test_ppo_takes_optimizers_by_transformers_name_and_refuses_a_precision_the_device_lacks(tmp_path, sft_dir):
    data = write_data_dir(tmp_path / "data", rows=32)
    rewards = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")])
    fast = dict(
        rollout_batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=1,
        total_episodes=16,
        response_length=4,
        num_threads=1,
        save_steps=2,
    )
    ppo.train(
        ppo.PpoConfig(optim="sgd", learning_rate=0.05, **fast),
        rewards,
        sft_dir,
        None,
        data,
        tmp_path / "out",
        tmp_path / "work",
    )
    groups = torch.load(tmp_path / "work" / "checkpoint-2" / "optimizer.pt", weights_only=True)["param_groups"]
    assert "momentum" in groups[0] and "betas" not in groups[0] and groups[0]["weight_decay"] == 0.0
    assert unchanged(trainable(load_base_model(SMALL_MODEL)[0]), load_causal_lm(tmp_path / "out" / "model")[0]) == []
    with pytest.raises(
        ValidationError,
        match=r"optim='adamw_tourch' is not an optimizer of transformers \(did you mean 'adamw_torch'\?\)",
    ):
        ppo.PpoConfig(optim="adamw_tourch")
    with pytest.raises(
        ValidationError, match=r"optim='sgd' and optimizer_factory='tests.user_code:sgd' both choose the optimizer"
    ):
        ppo.PpoConfig(optim="sgd", optimizer_factory="tests.user_code:sgd")
    with pytest.raises(ValidationError, match="bf16 and fp16 are both on"):
        ppo.PpoConfig(bf16=True, fp16=True)
    if not torch.cuda.is_available():
        for field, error in (
            ("fp16", "fp16=true needs a CUDA GPU; this machine trains on cpu"),
            ("tf32", "tf32=true needs an Ampere or newer GPU"),
        ):
            with pytest.raises(ValueError, match=error):
                ppo.train(
                    ppo.PpoConfig(**{field: True}, **fast),
                    rewards,
                    sft_dir,
                    None,
                    data,
                    tmp_path / field,
                    tmp_path / f"{field}-work",
                )
            assert not (tmp_path / field).exists()
