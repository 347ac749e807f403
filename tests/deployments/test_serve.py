from deployments.serve import deployments
from flows.params import PipelineParams


def test_deployments_carry_valid_typed_parameters_and_the_retrain_schedule():
    made = {d.name: d for d in deployments(retrain_cron="0 4 * * 0")}
    assert set(made) == {"full", "dpo", "grpo", "rloo", "retrain", "eval"}
    assert PipelineParams.model_validate(made["full"].parameters["params"]).algorithm == "ppo"
    assert PipelineParams.model_validate(made["grpo"].parameters["params"]).algorithm == "grpo"
    assert all(d.enforce_parameter_schema for d in made.values())
    assert [s.schedule.cron for s in made["retrain"].schedules] == ["0 4 * * 0"]
    assert not made["full"].schedules
    schema = made["full"]._parameter_openapi_schema.model_dump()
    assert schema["definitions"]["PipelineParams"]["properties"]["algorithm"]["enum"] == ["dpo", "grpo", "rloo", "ppo"]
