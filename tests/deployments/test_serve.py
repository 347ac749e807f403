import inspect

from rlhf_pipeline.deployments.serve import deployments
from rlhf_pipeline.flows.evaluate import EvalParams, rlhf_eval
from rlhf_pipeline.flows.params import PipelineParams, from_flow_parameters, load_params, parameter_order
from rlhf_pipeline.flows.rlhf import rlhf
from rlhf_pipeline.tasks.stages import ALGORITHMS
from rlhf_pipeline.trainers.ppo import PpoConfig


def test_deployments_carry_valid_typed_parameters_and_the_retrain_schedule():
    made = {
        d.name: d
        for d in deployments(retrain_cron="0 4 * * 0", retrain_overrides=["data.preference.path=/fresh/*.jsonl"])
    }
    assert set(made) == {"full", "retrain", "eval", *(a for a in ALGORITHMS if a != "ppo")} >= {"dpo", "grpo", "rloo"}
    assert PipelineParams.model_validate(made["full"].parameters).algorithm == "ppo"
    assert PipelineParams.model_validate(made["grpo"].parameters).algorithm == "grpo"
    assert made["retrain"].parameters["data"]["preference"]["path"] == "/fresh/*.jsonl"
    assert made["full"].parameters["data"]["preference"]["path"] != "/fresh/*.jsonl"
    assert EvalParams.model_validate(made["eval"].parameters).policy == "models:/rlhf-policy@candidate"
    assert all(d.enforce_parameter_schema for d in made.values())
    assert [s.schedule.cron for s in made["retrain"].schedules] == ["0 4 * * 0"]
    assert not made["full"].schedules


def undescribed(schema: dict) -> list[str]:
    """Every property, at any depth, that the UI form would show without a description."""
    missing = []

    def visit(properties: dict, where: str) -> None:
        for name, prop in properties.items():
            if not prop.get("description"):
                missing.append(f"{where}.{name}")

    visit(schema["properties"], "flow")
    for model, definition in schema.get("definitions", {}).items():
        visit(definition.get("properties", {}), model)
    return missing


def test_flow_parameters_are_the_typed_params_with_a_description_on_every_field():
    for flow, model in ((rlhf, PipelineParams), (rlhf_eval, EvalParams)):
        assert sorted(inspect.signature(flow.fn).parameters) == sorted(model.model_fields)
        made = next(d for d in deployments() if d._parameter_openapi_schema and d.entrypoint.endswith(flow.fn.__name__))
        schema = made._parameter_openapi_schema.model_dump()
        assert undescribed(schema) == []
    schema = next(d for d in deployments() if d.name == "full")._parameter_openapi_schema.model_dump()
    assert schema["properties"]["algorithm"]["enum"] == list(ALGORITHMS)
    own = rlhf.to_deployment(
        name="plain"
    )._parameter_openapi_schema.model_dump()  # the flow's order; each deployment's leads with its algorithm
    assert [
        name for name, _ in sorted(own["properties"].items(), key=lambda item: item[1]["position"])
    ] == parameter_order()
    assert schema["properties"]["ppo"]["$ref"] == "#/definitions/PpoConfig"
    assert schema["definitions"]["PpoConfig"]["additionalProperties"] is False  # a misspelt field is refused
    assert schema["definitions"]["PpoConfig"]["properties"]["learning_rate"]["exclusiveMinimum"] == 0
    loss = schema["definitions"]["DpoConfig"]["properties"]["loss_type"]
    assert "sigmoid" in loss["items"]["enum"]


def test_a_partial_block_changes_its_fields_and_keeps_the_rest_of_the_preset():
    preset = load_params("tiny", algorithm="ppo")
    # What Prefect hands the flow for `-p ppo='{"kl_coef": 0.2}'` on the `full` deployment.
    given = {**dict(preset), "ppo": PpoConfig.model_validate({"kl_coef": 0.2})}
    params = from_flow_parameters(PipelineParams, given)
    assert params.ppo.kl_coef == 0.2
    assert params.ppo.total_episodes == preset.ppo.total_episodes != PpoConfig().total_episodes
    assert params.model_dump(exclude={"ppo"}) == preset.model_dump(exclude={"ppo"})


def test_each_deployments_form_leads_with_its_algorithm_and_puts_the_blocks_it_skips_last_marked_unused():
    import copy

    from rlhf_pipeline.flows.rlhf import rlhf as flow

    made = {d.name: d for d in deployments()}
    plain = flow.to_deployment(name="plain")._parameter_openapi_schema.model_dump()
    for name, algorithm in (("full", "ppo"), ("retrain", "ppo"), ("grpo", "grpo"), ("dpo", "dpo")):
        schema = made[name]._parameter_openapi_schema.model_dump()
        order = sorted(schema["properties"], key=lambda p: schema["properties"][p]["position"])
        skipped = [s for s in ALGORITHMS if s != algorithm]
        assert order[:2] == ["algorithm", algorithm], order
        assert order[-len(skipped) :] == [s for s in parameter_order() if s in skipped], (
            order
        )  # last, in pipeline order
        for block in skipped:
            assert schema["properties"][block]["title"] == f"{block} (unused: this deployment runs {algorithm})"
        assert schema["properties"]["sft"]["title"] == "sft"
        # Only positions and titles differ from the flow's own schema: every type, bound and description stays.
        stripped = copy.deepcopy(schema)
        for prop, original in zip(
            stripped["properties"].values(), [plain["properties"][p] for p in stripped["properties"]]
        ):
            prop["position"], prop["title"] = original["position"], original["title"]
        assert stripped == plain
    online = made["full"]._parameter_openapi_schema.properties
    assert online["rewards"]["position"] == 2 and online["feedback"]["position"] == 3
