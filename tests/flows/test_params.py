import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlhf_pipeline.cli import main
from rlhf_pipeline.flows.params import PipelineParams, load_params
from rlhf_pipeline.flows.plan import stages


def test_tiny_preset_overrides_defaults_and_set_overrides_the_preset():
    params = load_params("tiny", ["sft.learning_rate=1e-4", "dpo.loss_type=[ipo]", "model.tiny.hidden_size=64"])
    assert params.sft.learning_rate == 1e-4
    assert params.sft.max_steps == 300  # from configs/tiny.yaml
    assert params.dpo.loss_type == ["ipo"]
    assert params.model.tiny.hidden_size == 64
    assert PipelineParams().sft.learning_rate == 2e-5  # the code default is TRL's


def test_bad_values_fail_before_any_model_loads():
    with pytest.raises(
        ValidationError, match="sft.max_length=4096 exceeds the tiny model.s model.tiny.max_position_embeddings=2048"
    ):
        load_params("tiny", ["sft.max_length=4096"])
    with pytest.raises(ValidationError, match="learning_rate"):
        load_params("tiny", ["sft.learning_rate=-1"])
    with pytest.raises(ValidationError, match="learning_rat"):  # a typo is an error, not ignored
        load_params("tiny", ["sft.learning_rat=0.1"])
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_params("nope")
    with pytest.raises(
        ValidationError, match="grpo.max_completion_length=64 leaves no room for a prompt in grpo.max_length=64"
    ):
        load_params("tiny", ["algorithm=grpo", "grpo.max_completion_length=64"])
    load_params("tiny", ["algorithm=dpo", "grpo.max_completion_length=64"])  # grpo does not run: not its business


def test_token_limits_follow_the_stages_that_read_each_dataset():
    # preference: read by rm (64) and dpo (48); preference_eval by rm alone; prompts by nobody in a dpo run.
    dpo = load_params("tiny", ["dpo.max_length=48"]).token_limits()
    assert dpo == {"sft": 64, "preference": 48, "preference_eval": 64}
    grpo = load_params("tiny", ["algorithm=grpo", "grpo.max_completion_length=8", "rm.max_length=60"]).token_limits()
    # The preset's grpo probes the held-out prompts (grpo.eval_steps): they must leave room for a completion too.
    assert grpo == {"sft": 64, "preference": 60, "preference_eval": 60, "prompts": 64 - 8, "prompts_eval": 64 - 8}
    no_rm = load_params(
        "tiny", ["algorithm=grpo", "eval.use_reward_model=false", "grpo.eval_steps=null"]
    ).token_limits()
    assert no_rm == {"sft": 64, "prompts": 64 - 8}  # rm does not run: its limit checks nothing


def test_cli_reports_invalid_parameters_with_exit_code_2(capsys):
    assert main(["params", "--set", "dpo.beta=-1"]) == 2
    assert "dpo.beta" in capsys.readouterr().err
    assert main(["params", "--set", "dpo.beta=0.3"]) == 0
    assert '"beta": 0.3' in capsys.readouterr().out


def test_parameter_schema_is_typed_and_documented():
    from rlhf_pipeline.flows.rlhf import rlhf

    schema = rlhf.parameters.model_dump()
    definitions = schema["definitions"]
    assert definitions["DpoConfig"]["properties"]["beta"]["description"].startswith("KL strength")
    assert "exclusiveMinimum" in definitions["DpoConfig"]["properties"]["beta"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dpo.trl_overrides={beta: 0.5}", "'beta' is this block's field `beta`: set it there"),
        ("sft.trl_overrides={output_dir: /tmp/x}", "'output_dir' is managed by the pipeline"),
        ("dpo.trl_overrides={betta: 0.5}", "'betta' \\(did you mean 'beta'\\?\\), which trl.DPOConfig does not have"),
        ("rm.trl_overrides={nope: 1}", "'nope', which trl.RewardConfig does not have"),
        (
            "sft.trl_overrides={activation_checkpointing: true}",
            "'activation_checkpointing': set this block's field `gradient_checkpointing` instead",
        ),
    ],
)
def test_trl_overrides_that_shadow_a_field_or_that_trl_lacks_fail_with_the_parameters(override, message, capsys):
    with pytest.raises(ValidationError, match=message):
        load_params("tiny", [override])
    assert main(["params", "--set", override]) == 2
    assert override.split(".")[0] in capsys.readouterr().err


def test_trl_overrides_that_trl_has_pass_through():
    params = load_params(
        "tiny", ["dpo.trl_overrides={truncation_mode: keep_start}", "sft.trl_overrides={save_total_limit: 1}"]
    )
    assert params.dpo.trl_arguments(Path("/tmp/work"))["truncation_mode"] == "keep_start"
    assert params.sft.trl_arguments(Path("/tmp/work"))["save_total_limit"] == 1


def test_a_preset_extends_another_and_lists_only_what_it_changes(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("extends: tiny\nsft: {max_steps: 7}\n")
    params = load_params(str(child))
    assert params.sft.max_steps == 7
    assert params.sft.learning_rate == 3e-3 == load_params("tiny").sft.learning_rate  # from tiny, not the code default
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"extends: {loop}\n")
    with pytest.raises(ValueError, match="extends .*loop.yaml, a cycle"):
        load_params(str(loop))


def test_the_gate_works_with_or_without_references_and_an_unmeasurable_gate_fails_with_the_parameters(tmp_path):
    from tests.foreign_models import chat_data

    no_references = [*chat_data(tmp_path), "rewards.reward_model_weight=1", "rewards.functions=[]"]
    # The default gate is the reward model's win rate against the champion, with or without reference answers ...
    assert load_params("tiny").gate().gate_metric == "eval/heldout/win_rate_vs_champion"
    chat = load_params("tiny", no_references)
    assert chat.gate().gate_metric == "eval/heldout/win_rate_vs_champion" and (
        chat.gate().min_value,
        chat.gate().min_lower_bound,
    ) == (0.5, 0.48)
    assert not any("exact_match" in name for name in chat.eval_metrics())
    # ... and without a reward model, the exact-match gain where references exist.
    kto = load_params("tiny", ["algorithm=kto", "eval.use_reward_model=false"]).gate()
    assert (kto.gate_metric, kto.min_value, kto.min_lower_bound) == (
        "eval/heldout/exact_match_gain_vs_champion",
        0.0,
        -0.02,
    )
    with pytest.raises(
        ValidationError,
        match=r"gate_metric='eval/heldout/exact_match_gain_vs_champion' is not a metric.*has no column 'answer'",
    ):
        load_params("tiny", [*no_references, "registry.gate_metric=eval/heldout/exact_match_gain_vs_champion"])
    with pytest.raises(
        ValidationError, match="no comparable metric: enable eval.use_reward_model or name an eval.gold_metric"
    ):
        load_params("tiny", [*no_references, "eval.use_reward_model=false", "algorithm=kto"])
    # A verifier named as the gold metric is a gate without references.
    gold = load_params(
        "tiny",
        [
            *no_references,
            "eval.use_reward_model=false",
            "algorithm=kto",
            "eval.gold_metric.path=tests.helpers:length_reward",
        ],
    )
    assert gold.gate().gate_metric == "eval/heldout/gold_gain_vs_champion"


def test_optimizers_and_precision_are_checked_with_the_parameters(tmp_path):
    import torch

    assert load_params("tiny", ["sft.optim=adafactor"]).sft.trl_arguments(tmp_path)["optim"] == "adafactor"
    with pytest.raises(
        ValidationError,
        match=r"optim='adamw_tourch' is not an optimizer of transformers \(did you mean 'adamw_torch'\?\)",
    ):
        load_params("tiny", ["sft.optim=adamw_tourch"])
    with pytest.raises(ValidationError, match="bf16 and fp16 are both on"):
        load_params("tiny", ["dpo.bf16=true", "dpo.fp16=true"])
    fp16 = load_params("tiny", ["rm.fp16=true"]).rm
    # The device decides: a GPU takes fp16, a CPU is refused by name before any weights load
    if torch.cuda.is_available():
        assert fp16.trl_arguments(tmp_path)["fp16"] is True
    else:
        with pytest.raises(ValueError, match="fp16=true needs a CUDA GPU; this machine trains on cpu"):
            fp16.trl_arguments(tmp_path)


def test_a_misspelt_import_path_fails_in_rlhf_params_naming_it(capsys):
    assert main(["params", "--set", "sft.optimizer_factory=tests.user_code:sgdd"]) == 2
    assert "optimizer_factory 'tests.user_code:sgdd': tests.user_code has no 'sgdd'" in capsys.readouterr().err
    callbacks = '[{"path": "tests.usr_code:CountHooks", "kwargs": {"out": "x.json"}}]'
    assert main(["params", "--set", f"ppo.callbacks={callbacks}"]) == 2
    assert "callback 'tests.usr_code:CountHooks': module 'tests.usr_code' does not import" in capsys.readouterr().err
    assert (
        main(["params", "--set", "rewards.functions=[{path: rlhf_pipeline.trainers.rewards.sort_task:exact_macth}]"])
        == 2
    )
    assert "reward function 'rlhf_pipeline.trainers.rewards.sort_task:exact_macth'" in capsys.readouterr().err
    # Spelt right, every path resolves, and each stage's block shows it.
    assert (
        main(["params", "--set", "sft.optimizer_factory=tests.user_code:sgd", "--set", "dpo.eval_strategy=steps"]) == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown["sft"]["optimizer_factory"] == "tests.user_code:sgd" and shown["dpo"]["eval_strategy"] == "steps"


def test_evaluating_while_training_needs_a_held_out_dataset():
    with pytest.raises(
        ValidationError, match=r"sft.eval_strategy='steps' evaluates on the sft_eval dataset.*or sft.eval_split"
    ):
        load_params("tiny", ["sft.eval_strategy=steps"])
    assert load_params("tiny", ["sft.eval_strategy=steps", "sft.eval_split=0.1"]).sft.held_out() == ()
    with pytest.raises(ValidationError, match=r"dpo.eval_strategy='steps' evaluates on the preference_eval dataset"):
        load_params(
            "tiny",
            ["algorithm=dpo", "dpo.eval_strategy=steps", "data.preference_eval=null", "eval.use_reward_model=false"],
        )
    with pytest.raises(ValidationError, match=r"eval_split=0.1 holds out demonstrations"):
        load_params("tiny", ["sft.eval_split=0.1"])


def test_a_kept_sft_adapter_needs_each_later_stage_to_choose_merge_or_stack():
    kept = ["sft.lora.enabled=true", "sft.lora.keep_adapter=true"]
    with pytest.raises(ValidationError, match=r"choose how rm continues from it: rm.lora.handoff=merge"):
        load_params("tiny", [*kept, "algorithm=dpo"])
    with pytest.raises(
        ValidationError, match=r"rm.lora.handoff=stack: the reward model starts from sft's adapter merged"
    ):
        load_params("tiny", [*kept, "rm.lora.handoff=stack", "dpo.lora.handoff=stack"])
    chosen = load_params("tiny", [*kept, "rm.lora.handoff=merge", "dpo.lora.handoff=stack"])
    assert chosen.dpo.lora.handoff == "stack"
    assert stages(
        load_params("tiny", [*kept, "algorithm=ppo", "eval.use_reward_model=false", "ppo.lora.handoff=merge"])
    ) == [
        "data",
        "sft",
        "ppo",
        "eval",
        "registry",
    ]
    with pytest.raises(ValidationError, match="sft.lora.handoff: sft starts from the base model"):
        load_params("tiny", ["sft.lora.handoff=merge"])


def test_eval_gold_metric_reaches_and_keys_only_the_online_stages_that_probe():
    from rlhf_pipeline.tasks.stages import BY_NAME
    from rlhf_pipeline.tasks.training import settings_of

    gold = "eval.gold_metric={path: tests.helpers:brevity}"
    quiet, probing = load_params(None, [gold]), load_params(None, [gold, "grpo.eval_steps=2"])
    assert "gold" in settings_of(BY_NAME["grpo"]) and "gold" in settings_of(BY_NAME["ppo"])
    assert "gold" not in settings_of(BY_NAME["dpo"])
    assert quiet.setting("gold", "grpo").function is None  # no probes: eval's gold metric does not key grpo
    assert probing.setting("gold", "grpo").function.path == "tests.helpers:brevity"
    assert probing.setting("gold", "grpo").code_paths() == ["tests.helpers:brevity"]
    assert probing.setting("rewards", "grpo") is probing.rewards


def test_pipeline_params_has_one_typed_block_per_row_of_the_table_in_its_order():
    from rlhf_pipeline.tasks.stages import STAGES

    blocks = [name for name in PipelineParams.model_fields if name in {stage.name for stage in STAGES}]
    assert blocks == [stage.name for stage in STAGES]
    for stage in STAGES:
        field = PipelineParams.model_fields[stage.name]
        assert field.annotation is stage.config and field.description == stage.description, stage.name
        assert isinstance(getattr(PipelineParams(), stage.name), stage.config)
