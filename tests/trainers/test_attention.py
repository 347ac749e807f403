"""`attn_implementation` per stage (issue 28, item 5): the choice reaches the models a stage trains, and what cannot
run here is refused with the parameters or before any weights load, naming the field and the reason."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from rlhf_pipeline.cli import main
from rlhf_pipeline.trainers.algorithms import rm, sft
from rlhf_pipeline.trainers.attention import device_problem
from rlhf_pipeline.trainers.config import CallbackSpec
from rlhf_pipeline.trainers.ppo import train as ppo
from tests.helpers import CI_PRESET, FAST, SMALL_MODEL, write_data_dir
from tests.trainers.algorithms.test_sft import losses_and_record
from tests.trainers.ppo.test_train import (
    EXACT_MATCH,
    tiny,  # noqa: F401 (the fixture)
)
from tests.trainers.ppo.test_train import FAST as PPO_FAST

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what this CPU-only machine refuses")


def test_sft_and_rm_train_with_the_attention_they_are_given(tmp_path):
    """sft trains the tiny model with eager and with sdpa attention: every attention layer dispatches on the one asked
    for, and the two log the same losses (the same math, within float error). rm then loads that sft model with eager
    attention: the sft's choice is not saved with the model, the loading stage's applies."""
    data = write_data_dir(tmp_path / "data")
    losses, seen = {}, {}
    for attention in ("eager", "sdpa"):
        config = sft.SftConfig(max_steps=3, attn_implementation=attention, **FAST)
        losses[attention], seen[attention] = losses_and_record(
            config, data, tmp_path, f"attention-{attention}", "RecordAttention"
        )
    layers = SMALL_MODEL.tiny.num_hidden_layers
    assert seen["eager"] == {"config": "eager", "dispatched": {"eager": layers}}
    assert seen["sdpa"] == {"config": "sdpa", "dispatched": {"sdpa": layers}}
    assert len(losses["eager"]) == 3 and losses["eager"] == pytest.approx(losses["sdpa"], abs=1e-4), losses

    saved = json.loads((tmp_path / "out-attention-sdpa" / "model" / "config.json").read_text())
    assert not any("attn" in key for key in saved)  # nothing pins the next stage's attention
    record = CallbackSpec(path="tests.user_code:RecordAttention", kwargs={"out": str(tmp_path / "rm.json")})
    config = rm.RewardModelConfig(max_steps=1, attn_implementation="eager", callbacks=[record], **FAST)
    rm.train(config, tmp_path / "out-attention-sdpa" / "model", data, tmp_path / "rm", tmp_path / "rm-work")
    assert json.loads((tmp_path / "rm.json").read_text()) == {"config": "eager", "dispatched": {"eager": layers}}


def test_ppo_computes_every_model_it_loads_with_the_attention_it_is_given(tiny, tmp_path):  # noqa: F811
    """Our own PPO loop loads the policy, the reference and the value model itself: in its first update (rollouts,
    reference log-probs, values, optimisation) every attention call of all three goes through eager."""
    record = CallbackSpec(path="tests.user_code:RecordAttention", kwargs={"out": str(tmp_path / "ppo.json")})
    config = ppo.PpoConfig(**PPO_FAST, attn_implementation="eager", callbacks=[record])
    ppo.train(config, EXACT_MATCH, tiny["sft"], None, tiny["data"], tmp_path / "out", tmp_path / "work")
    seen = json.loads((tmp_path / "ppo.json").read_text())
    assert seen["config"] == "eager" and list(seen["dispatched"]) == ["eager"], seen
    # Sampling 6 tokens alone calls each of the 2 layers 6 times: far more than the policy's training forwards.
    assert seen["dispatched"]["eager"] > 6 * SMALL_MODEL.tiny.num_hidden_layers


def test_an_unknown_or_uninstalled_attention_is_refused_with_the_parameters(capsys):
    """What is not installed (FlashAttention on this machine) or not transformers' fails while the parameters are
    read, with the field, the reason and the fix: `rlhf params` exits 2 before anything loads."""
    with pytest.raises(ValidationError) as refused:
        sft.SftConfig(attn_implementation="flash_attention_2")
    message = str(refused.value)
    assert "attn_implementation" in message and "needs FlashAttention 2, which is not installed" in message
    assert "pip install flash-attn" in message and "choose 'sdpa'" in message
    with pytest.raises(ValidationError, match=r"'flash_atention_2' is not .*did you mean 'flash_attention_2'"):
        rm.RewardModelConfig(attn_implementation="flash_atention_2")

    assert main(["params", "--config", CI_PRESET, "--set", "ppo.attn_implementation=flash_attention_3"]) == 2
    out = capsys.readouterr()
    printed = out.out + out.err
    assert "ppo.attn_implementation" in printed and "needs FlashAttention 3, which is not installed" in printed


@CPU_ONLY
def test_an_attention_this_device_cannot_run_is_refused_before_any_weights_load(tmp_path, capsys):
    """On a CPU: FlashAttention needs a CUDA GPU, and flex attention has no backward pass (torch 2.13), so a training
    stage refuses it where it starts, before loading anything (eval only samples: it may use it); `rlhf check`
    reports it as a problem the run would fail on."""
    assert device_problem("flash_attention_2", field="sft.attn_implementation") == (
        "sft.attn_implementation='flash_attention_2' runs on a CUDA GPU, and this machine has cpu: choose 'sdpa' "
        "(transformers' default) or 'eager'"
    )
    assert device_problem("flex_attention", training=False) is None and device_problem("eager") is None
    config = sft.SftConfig(max_steps=1, attn_implementation="flex_attention", **FAST)
    empty = tmp_path / "no-data"  # no dataset either: the refusal comes before anything is read
    with pytest.raises(ValueError, match=r"attn_implementation='flex_attention' cannot train on a CPU"):
        sft.train(config, SMALL_MODEL, empty, tmp_path / "out", tmp_path / "work")
    assert not (tmp_path / "out").exists()

    assert main(["check", "--config", CI_PRESET, "--set", "sft.attn_implementation=flex_attention"]) == 1
    out = capsys.readouterr().out
    assert "attention: sft flex_attention: sft.attn_implementation='flex_attention' cannot train on a CPU" in out
    assert "sft.attn_implementation='flex_attention' cannot run on this device" in out.splitlines()[-1]
