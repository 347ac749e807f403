"""An SFT LoRA adapter carried into the later stages, merged or stacked (lora.handoff), and reward-model adapters with
their score head."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from rlhf_pipeline.trainers.algorithms import dpo, rm, sft
from rlhf_pipeline.trainers.config import LoraConfig
from rlhf_pipeline.trainers.models.load import load_causal_lm, load_sequence_classifier, load_tokenizer
from rlhf_pipeline.trainers.ppo import train as ppo
from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig
from tests.helpers import FAST, SMALL_MODEL, write_data_dir

ADAPTER = LoraConfig(enabled=True, r=4, lora_alpha=8, lora_dropout=0.0, keep_adapter=True)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """sft trained with LoRA, its adapter kept (with the tiny base saved beside it, since no hub id names it)."""
    root = tmp_path_factory.mktemp("handoff")
    data = write_data_dir(root / "data", rows=32)
    # A large rate, so the adapter is far from its zero init and merged/stacked/base models differ.
    sft.train(
        sft.SftConfig(max_steps=4, lora=ADAPTER, **{**FAST, "learning_rate": 3e-2}),
        SMALL_MODEL,
        data,
        root / "sft",
        root / "sft-work",
    )
    return {"data": data, "model": root / "sft" / "model"}


def logits(model, tokenizer, text: str = "sort 3142 -> 1234"):
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_kept_adapter_loads_merged_or_stacked_to_the_same_logits(adapter):
    files = {p.name for p in adapter["model"].iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "base"} <= files and "model.safetensors" not in files
    merged, tokenizer = load_causal_lm(adapter["model"], "merge")
    stacked, _ = load_causal_lm(adapter["model"], "stack")
    assert hasattr(stacked, "peft_config") and not hasattr(merged, "peft_config")
    assert torch.allclose(logits(merged, tokenizer), logits(stacked, tokenizer), atol=1e-4)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapter["model"] / "base")
    # The adapter does something
    assert not torch.allclose(logits(base, tokenizer), logits(merged, tokenizer), atol=1e-3)
    with pytest.raises(
        ValueError, match=r"holds a LoRA adapter: choose how to continue from it \(lora.handoff: merge or stack\)"
    ):
        load_causal_lm(adapter["model"], None)


def test_dpo_on_a_stacked_adapter_starts_at_ln2_with_the_policy_equal_to_its_reference(adapter, tmp_path):
    logged: list[tuple[int, dict]] = []
    cfg = dpo.DpoConfig(max_steps=3, lora=LoraConfig(handoff="stack"), **{**FAST, "learning_rate": 1e-2})
    dpo.train(
        cfg,
        adapter["model"],
        adapter["data"],
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    first = next(values for step, values in logged if step == 1 and "dpo/train/loss" in values)
    assert first["dpo/train/loss"] == pytest.approx(math.log(2), abs=1e-3)
    # rewards = beta * (log pi - log pi_ref): zero at step 0 means the policy's log-probabilities equal the reference's.
    assert abs(first["dpo/train/rewards_chosen"]) < 1e-6 and abs(first["dpo/train/rewards_rejected"]) < 1e-6
    later = [values["dpo/train/loss"] for step, values in logged if step == 3 and "dpo/train/loss" in values]
    assert later and later[0] != pytest.approx(math.log(2), abs=1e-4)  # the stacked adapter trained
    # Published merged (keep_adapter off): a whole model, and not the sft one.
    out, tokenizer = load_causal_lm(tmp_path / "out" / "model")
    assert not torch.allclose(
        logits(out, tokenizer), logits(load_causal_lm(adapter["model"], "merge")[0], tokenizer), atol=1e-5
    )


def test_dpo_on_a_merged_adapter_trains_its_own_lora_and_an_unchosen_handoff_fails_before_training(adapter, tmp_path):
    merged = dpo.DpoConfig(max_steps=2, lora=LoraConfig(enabled=True, r=4, handoff="merge"), **FAST)
    dpo.train(merged, adapter["model"], adapter["data"], tmp_path / "out", tmp_path / "work")
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
    with pytest.raises(
        ValueError, match="holds sft's LoRA adapter \\(sft.lora.keep_adapter\\): choose lora.handoff=merge or stack"
    ):
        dpo.train(
            dpo.DpoConfig(max_steps=2, **FAST),
            adapter["model"],
            adapter["data"],
            tmp_path / "none",
            tmp_path / "none-work",
        )
    assert not (tmp_path / "none").exists()


def test_a_reward_model_adapter_keeps_its_score_head(adapter, tmp_path):
    cfg = rm.RewardModelConfig(
        max_steps=3,
        lora=LoraConfig(enabled=True, r=4, keep_adapter=True, handoff="merge"),
        **{**FAST, "learning_rate": 1e-2},
    )
    rm.train(cfg, adapter["model"], adapter["data"], tmp_path / "rm", tmp_path / "rm-work")
    saved = load_file(tmp_path / "rm" / "model" / "adapter_model.safetensors")
    # The head travels in the adapter (peft modules_to_save)
    assert any("score" in name for name in saved), sorted(saved)[:5]
    tokenizer = load_tokenizer(tmp_path / "rm" / "model")
    first, second = (
        load_sequence_classifier(tmp_path / "rm" / "model"),
        load_sequence_classifier(tmp_path / "rm" / "model"),
    )
    assert torch.equal(logits(first, tokenizer), logits(second, tokenizer))  # no fresh (random) head on load
    with pytest.raises(ValueError, match="the reward model starts from it merged"):
        rm.train(
            cfg.model_copy(update={"lora": LoraConfig(handoff="stack")}),
            adapter["model"],
            adapter["data"],
            tmp_path / "x",
            tmp_path / "x-work",
        )


def test_ppo_on_a_stacked_adapter_has_no_kl_to_its_reference_at_the_first_update(adapter, tmp_path):
    logged: list[tuple[int, dict]] = []
    rewards = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")])
    cfg = ppo.PpoConfig(
        rollout_batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=1,
        total_episodes=24,
        response_length=4,
        logging_steps=1,
        num_threads=1,
        learning_rate=1e-2,
        lora=LoraConfig(handoff="stack"),
    )
    ppo.train(
        cfg,
        rewards,
        adapter["model"],
        None,
        adapter["data"],
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    kl = {step: values["ppo/train/kl"] for step, values in logged}
    # The frozen copy is the reference; the trained adapter moves away from it
    assert abs(kl[1]) < 1e-5 and abs(kl[3]) > 1e-5
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()


def test_grpo_trains_a_stacked_adapter_against_its_frozen_copy(adapter, tmp_path):
    from rlhf_pipeline.trainers.algorithms import grpo

    logged: list[tuple[int, dict]] = []
    rewards = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")])
    cfg = grpo.GrpoConfig(
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        lora=LoraConfig(handoff="stack"),
        **{k: v for k, v in FAST.items() if k != "per_device_train_batch_size"},
    )
    grpo.train(
        cfg,
        rewards,
        adapter["model"],
        None,
        adapter["data"],
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    kl = [values["grpo/train/kl"] for step, values in logged if step == 1 and "grpo/train/kl" in values]
    assert kl and abs(kl[0]) < 1e-6  # the reference is the frozen copy of sft's adapter, not the bare base
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()


def test_qlora_needs_bitsandbytes_and_a_gpu_and_says_which_is_missing(adapter, tmp_path):
    import importlib.util

    assert importlib.util.find_spec("bitsandbytes") is None  # this machine: the parameters name the package
    with pytest.raises(
        ValueError,
        match=r"lora.quantization='4bit' \(QLoRA\) needs bitsandbytes and a CUDA GPU; bitsandbytes is not installed",
    ):
        LoraConfig(enabled=True, quantization="4bit")
    with pytest.raises(ValueError, match="an adapter cannot be merged into 4-bit weights; stack it"):
        LoraConfig(handoff="merge", quantization="4bit")
    with pytest.raises(ValueError, match="set lora.enabled=true"):
        LoraConfig(quantization="4bit")
    # With bitsandbytes present on a CPU machine: the stage names the device, before any weights load
    if not torch.cuda.is_available():
        qlora = LoraConfig.model_construct(**{**dict(LoraConfig(enabled=True, r=4)), "quantization": "4bit"})
        cfg = sft.SftConfig.model_construct(**{**dict(sft.SftConfig(max_steps=2, **FAST)), "lora": qlora})
        with pytest.raises(
            ValueError, match=r"\(QLoRA\): bitsandbytes quantizes on a CUDA GPU, and this machine trains on cpu"
        ):
            sft.train(cfg, SMALL_MODEL, adapter["data"], tmp_path / "out", tmp_path / "work")
        assert not (tmp_path / "out").exists()


def test_a_sharded_lora_model_is_saved_from_its_gathered_state_dict(adapter, tmp_path):
    """Under ZeRO-3 or FSDP a rank holds only its shard, so `save_on_main` rebuilds the peft model from the gathered
    state dict (`unsharded_copy`). The originals' own weights are emptied after the gather, as ZeRO-3 leaves them: the
    copy can only come from the dict. A stacked policy with TRL's frozen "ref" adapter, and a reward model with its
    score head."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    from rlhf_pipeline.trainers.models.handoff import unsharded_copy
    from rlhf_pipeline.trainers.models.load import save_model

    def gather_and_empty(model) -> dict:
        gathered = {key: value.clone() for key, value in model.state_dict().items()}
        for parameter in model.parameters():
            parameter.data = torch.empty(0)
        return gathered

    stacked, tokenizer = load_causal_lm(adapter["model"], "stack")
    stacked.load_adapter(str(adapter["model"]), adapter_name="ref")
    stacked.set_adapter("default")
    expected = logits(stacked, tokenizer)
    copied = unsharded_copy(stacked, gather_and_empty(stacked))
    assert torch.allclose(logits(copied, tokenizer), expected, atol=1e-6)
    save_model(copied, tokenizer, tmp_path / "policy")  # merged; the "ref" adapter is dropped
    assert torch.allclose(logits(load_causal_lm(tmp_path / "policy")[0], tokenizer), expected, atol=1e-4)

    merged, _ = load_causal_lm(adapter["model"], "merge")
    save_model(merged, tokenizer, tmp_path / "sft-merged")
    scorer = get_peft_model(
        load_sequence_classifier(tmp_path / "sft-merged"), PeftLora(r=4, lora_alpha=8, task_type="SEQ_CLS")
    )
    with torch.no_grad():
        scorer.base_model.model.score.modules_to_save["default"].weight.normal_()  # a head unlike a fresh one
    expected = logits(scorer, tokenizer)
    copied = unsharded_copy(scorer, gather_and_empty(scorer))
    save_model(copied, tokenizer, tmp_path / "rm", keep_adapter=True)
    assert torch.allclose(logits(load_sequence_classifier(tmp_path / "rm"), tokenizer), expected, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_lora_trains_the_rows_of_the_tokens_a_chat_template_added_and_later_stages_load_them(tmp_path, tied):
    """A GPT-2-style checkpoint without ChatML's tokens, `model.chat_template=chatml`: sft under LoRA trains their
    embedding rows (and the untied lm_head's) as peft trainable tokens, and the kept adapter loads onto the named base,
    whose vocabulary lacks them."""
    from datasets import Dataset
    from transformers import GPT2LMHeadModel

    from rlhf_pipeline.trainers.config import ModelConfig
    from tests.foreign_models import chat_data, gpt2_folder

    folder = gpt2_folder(tmp_path / "gpt2")
    if not tied:
        untied = GPT2LMHeadModel.from_pretrained(folder, tie_word_embeddings=False)
        untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
        untied.save_pretrained(folder, safe_serialization=True)
    chat_data(tmp_path / "chat")
    (tmp_path / "data" / "datasets").mkdir(parents=True)
    Dataset.from_json(str(tmp_path / "chat" / "sft.jsonl")).to_parquet(
        str(tmp_path / "data" / "datasets" / "sft.parquet")
    )
    model = ModelConfig(name_or_path=str(folder), chat_template="chatml")
    cfg = sft.SftConfig(max_steps=3, lora=ADAPTER, **{**FAST, "learning_rate": 3e-2})
    sft.train(cfg, model, tmp_path / "data", tmp_path / "sft", tmp_path / "sft-work")

    out = tmp_path / "sft" / "model"
    saved = load_file(out / "adapter_model.safetensors")
    deltas = {name.split(".")[-3]: value for name, value in saved.items() if name.endswith("trainable_tokens_delta")}
    assert set(deltas) == {"wte", "lm_head"}, sorted(saved)  # the tied head's rows are saved beside the embeddings' too
    tokenizer = load_tokenizer(out)
    added = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_start|>", "<|im_end|>")]
    # Rows the checkpoint lacks
    assert min(added) >= GPT2LMHeadModel.from_pretrained(folder).get_input_embeddings().weight.shape[0]
    merged, _ = load_causal_lm(out, "merge")
    stacked, _ = load_causal_lm(out, "stack")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe the red cat."}], tokenize=False, add_generation_prompt=True
    )
    assert torch.allclose(logits(merged, tokenizer, text), logits(stacked, tokenizer, text), atol=1e-4)
    # The rows come from the adapter, whatever the base held; an untied head trained rows of its own.
    assert torch.equal(merged.get_input_embeddings().weight[added], deltas["wte"])
    assert torch.equal(merged.get_output_embeddings().weight[added], deltas["lm_head"])
    assert torch.equal(deltas["wte"], deltas["lm_head"]) == tied
