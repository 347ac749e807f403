import shutil

from rlhf_pipeline.trainers import sft
from rlhf_pipeline.trainers.base import load_base_model
from rlhf_pipeline.trainers.common import COMPLETE, last_checkpoint, load_causal_lm, metric_name

from tests.helpers import FAST, SMALL_MODEL, changed, state_dict_copy, write_data_dir


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
    before = state_dict_copy(load_base_model(SMALL_MODEL)[0])
    after, tokenizer = load_causal_lm(tmp_path / "out" / "model")
    assert changed(before, state_dict_copy(after))
    losses = [v["sft/train/loss"] for v, _ in logged if "sft/train/loss" in v]
    assert len(losses) == 12 and losses[-1] < losses[0] * 0.95
    assert metrics["sft/train/loss"] == losses[-1]
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
    assert tokenizer.eos_token == "<|endoftext|>"


def test_sft_resumes_from_the_newest_checkpoint(tmp_path):
    data = write_data_dir(tmp_path / "data")
    config = sft.SftConfig(max_steps=4, **{**FAST, "save_steps": 2})
    sft.train(config, SMALL_MODEL, data, tmp_path / "first", tmp_path / "work")
    steps: list[int] = []
    # Same work dir, more steps: training continues at step 4, not from 0.
    sft.train(config.model_copy(update={"max_steps": 6}), SMALL_MODEL, data, tmp_path / "second", tmp_path / "work", lambda values, step: steps.append(step))
    assert steps and min(steps) > 4


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
    steps: list[int] = []
    sft.train(config.model_copy(update={"max_steps": 6}), SMALL_MODEL, data, tmp_path / "second", tmp_path / "work", lambda values, step: steps.append(step))
    assert min(steps) == 5 and max(steps) == 6  # resumed after step 4, from the complete checkpoint


def test_metric_names_follow_stage_split_name():
    assert metric_name("rm", "eval_accuracy") == "rm/eval/accuracy"
    assert metric_name("dpo", "rewards/chosen") == "dpo/train/rewards_chosen"
    assert metric_name("sft", "train_runtime") == "sft/train/runtime"


def test_lora_trains_adapters_and_saves_a_merged_loadable_model(tmp_path):
    from rlhf_pipeline.trainers.common import LoraConfig

    data = write_data_dir(tmp_path / "data")
    config = sft.SftConfig(max_steps=3, lora=LoraConfig(enabled=True, r=4, lora_alpha=8), **FAST)
    sft.train(config, SMALL_MODEL, data, tmp_path / "out", tmp_path / "work")
    files = {p.name for p in (tmp_path / "out" / "model").iterdir()}
    assert "model.safetensors" in files and "adapter_config.json" not in files  # merged
    before = state_dict_copy(load_base_model(SMALL_MODEL)[0])
    after = state_dict_copy(load_causal_lm(tmp_path / "out" / "model")[0])
    assert before.keys() == after.keys() and changed(before, after)
