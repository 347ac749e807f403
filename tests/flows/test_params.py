import pytest
from pydantic import ValidationError
from rlhf_pipeline.flows.cli import main
from rlhf_pipeline.flows.params import PipelineParams, load_params


def test_tiny_preset_overrides_defaults_and_set_overrides_the_preset():
    params = load_params("tiny", ["sft.learning_rate=1e-4", "dpo.loss_type=[ipo]", "model.tiny.hidden_size=64"])
    assert params.sft.learning_rate == 1e-4
    assert params.sft.max_steps == 300  # from configs/tiny.yaml
    assert params.dpo.loss_type == ["ipo"]
    assert params.model.tiny.hidden_size == 64
    assert PipelineParams().sft.learning_rate == 2e-5  # the code default is TRL's


def test_bad_values_fail_before_any_model_loads():
    with pytest.raises(ValidationError, match="sft.max_length=4096 exceeds the tiny model.s model.tiny.max_position_embeddings=2048"):
        load_params("tiny", ["sft.max_length=4096"])
    with pytest.raises(ValidationError, match="learning_rate"):
        load_params("tiny", ["sft.learning_rate=-1"])
    with pytest.raises(ValidationError, match="learning_rat"):  # a typo is an error, not ignored
        load_params("tiny", ["sft.learning_rat=0.1"])
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_params("nope")
    with pytest.raises(ValidationError, match="grpo.max_completion_length=64 leaves no room for a prompt in grpo.max_length=64"):
        load_params("tiny", ["algorithm=grpo", "grpo.max_completion_length=64"])
    load_params("tiny", ["algorithm=dpo", "grpo.max_completion_length=64"])  # grpo does not run: not its business


def test_token_limits_follow_the_stages_that_read_each_dataset():
    dpo = load_params("tiny", ["dpo.max_length=48"]).token_limits()
    assert dpo == {"sft": 64, "preference": 48, "preference_eval": 48}
    grpo = load_params("tiny", ["algorithm=grpo", "grpo.max_completion_length=8"]).token_limits()
    assert grpo["prompts"] == grpo["prompts_eval"] == 64 - 8 and grpo["preference"] == 64  # the rm reads preferences


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
