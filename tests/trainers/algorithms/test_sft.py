import json
import shutil

import pytest
from safetensors.torch import load_file

from rlhf_pipeline.trainers.algorithms import sft
from rlhf_pipeline.trainers.algorithms.loop import COMPLETE, last_checkpoint, metric_name
from rlhf_pipeline.trainers.data import load_split
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import load_causal_lm
from tests.helpers import FAST, SMALL_MODEL, trainable, unchanged, write_data_dir


def train_on_to_six(config, data, tmp_path) -> list[tuple[int, dict]]:
    """Train the same work dir on to step 6; (step, values) of every log call."""
    logged: list[tuple[int, dict]] = []
    sft.train(
        config.model_copy(update={"max_steps": 6}),
        SMALL_MODEL,
        data,
        tmp_path / "second",
        tmp_path / "work",
        lambda values, step: logged.append((step, values)),
    )
    return logged


def test_sft_trains_the_tiny_model_and_lowers_its_loss(tmp_path):
    data = write_data_dir(tmp_path / "data")
    logged: list[tuple[dict, int]] = []
    metrics = sft.train(
        sft.SftConfig(max_steps=12, **FAST),
        SMALL_MODEL,
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append((values, step)),
    )
    before = trainable(load_base_model(SMALL_MODEL)[0])
    after, tokenizer = load_causal_lm(tmp_path / "out" / "model")
    assert unchanged(before, after) == []
    # Row by row, the embedding moves exactly for the tokens the model reads with a label after them: AdamW
    # (weight_decay=0) leaves a row with zero gradient in place, so PAD (masked), the special tokens, bytes the
    # data never uses, and EOS (only ever the last token, whose prediction has no label) keep their init.
    rows = load_split(data, "sft")
    read = {
        i
        for prompt, completion in zip(rows["prompt"], rows["completion"])
        for i in tokenizer(prompt + completion)["input_ids"]
    }
    moved = (before["model.embed_tokens.weight"] != after.model.embed_tokens.weight).any(dim=1)
    assert moved.nonzero().flatten().tolist() == sorted(read)
    losses = [v["sft/train/loss"] for v, _ in logged if "sft/train/loss" in v]
    assert len(losses) == 12 and losses[-1] < losses[0] * 0.95
    assert metrics["sft/train/loss"] == losses[-1]
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
    assert tokenizer.eos_token == "<|endoftext|>"


def test_sft_resumes_from_the_newest_checkpoint(tmp_path):
    data = write_data_dir(tmp_path / "data")
    config = sft.SftConfig(max_steps=4, **{**FAST, "save_steps": 2})
    sft.train(config, SMALL_MODEL, data, tmp_path / "first", tmp_path / "work")
    # Same work dir, more steps: training continues at step 4, not from 0.
    logged = train_on_to_six(config, data, tmp_path)
    assert [step for step, values in logged if "sft/train/loss" in values] == [5, 6]


def test_a_checkpoint_cut_off_mid_write_is_never_used(tmp_path):
    data = write_data_dir(tmp_path / "data")
    config = sft.SftConfig(max_steps=4, **{**FAST, "save_steps": 2})
    sft.train(config, SMALL_MODEL, data, tmp_path / "first", tmp_path / "work")
    assert last_checkpoint(tmp_path / "work") == str(tmp_path / "work" / "checkpoint-4")
    # The process died while writing checkpoint-6: weights and a truncated trainer state, no marker.
    shutil.copytree(tmp_path / "work" / "checkpoint-4", tmp_path / "work" / "checkpoint-6")
    (tmp_path / "work" / "checkpoint-6" / COMPLETE).unlink()
    (tmp_path / "work" / "checkpoint-6" / "trainer_state.json").write_text('{"global_step": 6, "log_hist')
    assert last_checkpoint(tmp_path / "work") == str(tmp_path / "work" / "checkpoint-4")
    logged = train_on_to_six(config, data, tmp_path)
    # Resumed after step 4, from the complete checkpoint (the closing summary, logged at step 6 too, has no loss).
    assert [step for step, values in logged if "sft/train/loss" in values] == [5, 6]


def test_metric_names_follow_stage_split_name():
    assert metric_name("rm", "eval_accuracy") == "rm/eval/accuracy"
    assert metric_name("dpo", "rewards/chosen") == "dpo/train/rewards_chosen"
    assert metric_name("sft", "train_runtime") == "sft/train/runtime"


def test_lora_trains_adapters_and_saves_a_merged_loadable_model(tmp_path):
    from rlhf_pipeline.trainers.config import LoraConfig

    data = write_data_dir(tmp_path / "data")
    # save_steps=1: the work dir keeps the adapters of steps 2 and 3 (TRL keeps the two newest checkpoints).
    config = sft.SftConfig(max_steps=3, lora=LoraConfig(enabled=True, r=4, lora_alpha=8), **{**FAST, "save_steps": 1})
    sft.train(config, SMALL_MODEL, data, tmp_path / "out", tmp_path / "work")
    files = {p.name for p in (tmp_path / "out" / "model").iterdir()}
    assert "model.safetensors" in files and "adapter_config.json" not in files  # merged
    before = trainable(load_base_model(SMALL_MODEL)[0])
    after = load_causal_lm(tmp_path / "out" / "model")[0]
    assert before.keys() == dict(after.named_parameters()).keys()
    # peft's "all-linear" adapts every Linear of the blocks but not the output head: once merged, exactly
    # those weights moved, and the frozen embedding, norms and lm_head are bit-identical to the base model.
    assert unchanged(before, after) == sorted(name for name in before if "_proj." not in name)
    adapters = load_file(tmp_path / "work" / "checkpoint-2" / "adapter_model.safetensors")
    assert len(adapters) == 2 * 7 * 2  # 2 blocks x 7 linear layers x (lora_A, lora_B)
    # Every adapter trains
    assert unchanged(adapters, load_file(tmp_path / "work" / "checkpoint-3" / "adapter_model.safetensors")) == []


def test_an_optimizer_and_schedule_by_transformers_name_train_and_are_checkpointed(tmp_path):
    import torch

    data = write_data_dir(tmp_path / "data")
    cfg = sft.SftConfig(
        max_steps=4,
        optim="sgd",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.5},
        **{**FAST, "learning_rate": 0.5, "save_steps": 4},
    )
    logged: list[dict] = []
    sft.train(cfg, SMALL_MODEL, data, tmp_path / "out", tmp_path / "work", lambda values, step: logged.append(values))
    assert unchanged(trainable(load_base_model(SMALL_MODEL)[0]), load_causal_lm(tmp_path / "out" / "model")[0]) == []
    # The checkpoint holds SGD's state (momentum, no Adam betas) ...
    groups = torch.load(tmp_path / "work" / "checkpoint-4" / "optimizer.pt", weights_only=True)["param_groups"]
    assert "momentum" in groups[0] and "betas" not in groups[0]
    # ... and the schedule decays to min_lr_rate * lr, not to 0.
    rates = [values["sft/train/learning_rate"] for values in logged if "sft/train/learning_rate" in values]
    assert rates[0] > rates[-1] >= 0.25 - 1e-9


def losses_and_record(config, data, tmp_path, name: str, recorder: str) -> tuple[list[float], object]:
    """Train `config` with the callback `tests.user_code:<recorder>` writing into `<name>.json`; the logged
    training losses, step by step, and what the callback wrote."""
    from rlhf_pipeline.trainers.config import CallbackSpec

    logged: list[float] = []
    record = CallbackSpec(path=f"tests.user_code:{recorder}", kwargs={"out": str(tmp_path / f"{name}.json")})
    sft.train(
        config.model_copy(update={"callbacks": [record]}),
        SMALL_MODEL,
        data,
        tmp_path / f"out-{name}",
        tmp_path / f"work-{name}",
        lambda values, step: logged.extend([values["sft/train/loss"]] if "sft/train/loss" in values else []),
    )
    return logged, json.loads((tmp_path / f"{name}.json").read_text())


def test_padding_free_batches_train_the_same_losses_as_padded_ones(tmp_path):
    """padding_free concatenates each batch's rows (no pad tokens; transformers masks the rows apart by their
    position_ids): the same rows, steps and seed log the same losses as padded batches, step by step."""
    data = write_data_dir(tmp_path / "data")
    losses, batches = {}, {}
    for padding_free in (False, True):
        config = sft.SftConfig(max_steps=3, padding_free=padding_free, **{**FAST, "per_device_train_batch_size": 4})
        losses[padding_free], batches[padding_free] = losses_and_record(
            config, data, tmp_path, f"batches-{padding_free}", "RecordBatches"
        )
    assert [b["shape"][0] for b in batches[False]] == [4, 4, 4] and all(b["mask"] for b in batches[False])
    # One row, no padding
    assert [b["shape"][0] for b in batches[True]] == [1, 1, 1] and not any(b["mask"] for b in batches[True])
    assert sum(b["shape"][1] for b in batches[True]) < sum(b["shape"][0] * b["shape"][1] for b in batches[False])
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], abs=1e-4), losses


def test_gradient_checkpointing_recomputes_activations_and_trains_the_same_losses(tmp_path):
    """Issue 28: sft with gradient checkpointing (non-reentrant) logs the loss curve of sft without it, within 1e-5,
    step by step; with it on, each decoder layer runs its forward twice a step (the backward pass recomputes it)."""
    data = write_data_dir(tmp_path / "data")
    losses, seen = {}, {}
    for checkpointing in (False, True):
        config = sft.SftConfig(max_steps=4, gradient_checkpointing=checkpointing, **FAST)
        losses[checkpointing], seen[checkpointing] = losses_and_record(
            config, data, tmp_path, f"checkpointing-{checkpointing}", "RecordCheckpointing"
        )
    layers = SMALL_MODEL.tiny.num_hidden_layers
    assert seen[False] == {"on": False, "forwards_per_layer": [1] * layers}
    assert seen[True] == {"on": True, "forwards_per_layer": [2] * layers}
    assert len(losses[True]) == 4 and losses[True] == pytest.approx(losses[False], abs=1e-5), losses


def test_assistant_only_loss_trains_qwen25s_assistant_turns_through_trls_training_template(tmp_path):
    """Issue 28: a Qwen2 folder with Qwen2.5-Instruct's exact chat template (no {% generation %} marks) trains with
    `assistant_only_loss`: TRL 1.16 tokenizes with its training version of the template, and the loss reads exactly
    each assistant reply with its `<|im_end|>` (and the newline after it), nothing of the system and user turns. The
    saved tokenizer keeps Qwen2.5's own template."""
    import re

    from rlhf_pipeline.trainers.config import CallbackSpec, ModelConfig
    from rlhf_pipeline.trainers.data import DatasetSpec, load_source
    from rlhf_pipeline.trainers.models.load import load_tokenizer
    from tests.foreign_models import chat_data, qwen25_folder, qwen25_template

    model = ModelConfig(name_or_path=str(qwen25_folder(tmp_path / "qwen2.5")))
    chat_data(tmp_path / "chat")
    (tmp_path / "data" / "datasets").mkdir(parents=True)
    load_source(DatasetSpec(path=str(tmp_path / "chat" / "sft.jsonl"))).to_parquet(
        str(tmp_path / "data" / "datasets" / "sft.parquet")
    )
    record = CallbackSpec(path="tests.user_code:RecordLabels", kwargs={"out": str(tmp_path / "labels.json")})
    config = sft.SftConfig(
        max_steps=2,
        assistant_only_loss=True,
        callbacks=[record],
        **{**FAST, "per_device_train_batch_size": 4, "max_length": 256},
    )
    logged: list[float] = []
    sft.train(
        config,
        model,
        tmp_path / "data",
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.extend([values["sft/train/loss"]] if "sft/train/loss" in values else []),
    )
    assert len(logged) == 2 and all(loss > 0 for loss in logged)
    tokenizer = load_tokenizer(tmp_path / "out" / "model")
    assert tokenizer.chat_template == qwen25_template()
    batch = json.loads((tmp_path / "labels.json").read_text())
    assert len(batch["input_ids"]) == 4
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        text = tokenizer.decode(ids)
        replies = re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, flags=re.DOTALL)
        questions = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, flags=re.DOTALL)
        assert len(replies) == 1 and len(questions) == 1, text
        trained = tokenizer.decode([i for i, label in zip(ids, labels) if label != -100])
        assert trained == f"\n{replies[0]}<|im_end|>\n", (trained, text)
        assert questions[0] not in trained and "system" not in trained
