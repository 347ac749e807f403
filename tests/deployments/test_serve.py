import copy
import inspect

import pytest

from rlhf_pipeline.deployments.serve import deployments
from rlhf_pipeline.flows.evaluate import EvalParams, rlhf_eval
from rlhf_pipeline.flows.params import PipelineParams, from_flow_parameters, load_params, parameter_order
from rlhf_pipeline.flows.rlhf import rlhf
from rlhf_pipeline.tasks.stages import ALGORITHMS
from rlhf_pipeline.trainers.ppo.train import PpoConfig


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
    loss = own["definitions"]["DpoConfig"]["properties"]["loss_type"]
    assert "sigmoid" in loss["items"]["enum"]


def test_a_partial_block_changes_its_fields_and_keeps_the_rest_of_the_preset():
    preset = load_params("tiny", algorithm="ppo")
    # What Prefect hands the flow for `-p ppo='{"kl_coef": 0.2}'` on the `full` deployment.
    given = {**dict(preset), "ppo": PpoConfig.model_validate({"kl_coef": 0.2})}
    params = from_flow_parameters(PipelineParams, given)
    assert params.ppo.kl_coef == 0.2
    assert params.ppo.total_episodes == preset.ppo.total_episodes != PpoConfig().total_episodes
    assert params.model_dump(exclude={"ppo"}) == preset.model_dump(exclude={"ppo"})


def test_each_deployments_form_shows_a_few_fields_and_refuses_a_misspelt_one_by_name():
    """The form (issue 44): the run's settings, `overrides`, and the model, the algorithm's block (`rewards` for an
    online one) and the data with the few fields most runs change, in that order; every field shown keeps the flow's
    type, bounds and description, and a block still refuses a key it does not have."""
    import jsonschema

    from rlhf_pipeline.deployments.serve import FORM
    from rlhf_pipeline.flows.rlhf import rlhf as flow

    made = {d.name: d for d in deployments()}
    plain = flow.to_deployment(name="plain")._parameter_openapi_schema.model_dump()
    for name, algorithm in (("full", "ppo"), ("retrain", "ppo"), ("grpo", "grpo"), ("dpo", "dpo")):
        schema = made[name]._parameter_openapi_schema.model_dump()
        order = sorted(schema["properties"], key=lambda p: schema["properties"][p]["position"])
        online = ["rewards"] if algorithm in ("ppo", "grpo") else []
        shown = ["algorithm", "preset", "experiment_name", "overrides", "model", algorithm, *online, "data", "no_cache"]
        assert order[: len(shown)] == shown, order
        # The other blocks stay parameters (`prefect deployment run -p sft=...`), last, with no field drawn
        assert sorted(order[len(shown) :]) == sorted(set(plain["properties"]) - set(shown))
        for block in order[len(shown) :]:
            assert schema["properties"][block]["title"] == f"{block} (its fields: through overrides)"
        definitions = schema["definitions"]
        config = schema["properties"][algorithm]["$ref"].rsplit("/", 1)[-1]
        block, every = definitions[config], plain["definitions"][config]["properties"]
        assert list(block["properties"]) == [field for field in FORM["algorithm"] if field in every]
        assert 0 < len(block["properties"]) <= 6
        assert "more through `overrides` (e.g." in schema["properties"][algorithm]["description"]
        for definition, original in ((d, plain["definitions"][n]) for n, d in definitions.items()):
            for field, prop in definition["properties"].items():
                assert prop == original["properties"][field]  # type, bounds and description as the flow's
            assert definition.get("additionalProperties") == original.get("additionalProperties")
        # What the form sends back (the deployment's values, two changed) is valid; a misspelt field is not.
        values = copy.deepcopy(made[name].parameters)
        values[algorithm]["learning_rate"] = 1e-4
        jsonschema.validate(values, schema)
        values[algorithm]["learning_rat"] = 1e-4
        with pytest.raises(jsonschema.ValidationError, match="learning_rat"):
            jsonschema.validate(values, schema)


def test_overrides_set_any_field_as_set_does_and_name_a_bad_item():
    params = load_params("tiny", overrides=["overrides=[dpo.warmup_steps=7, sft.max_steps=3]"])
    assert params.dpo.warmup_steps == 7 and params.sft.max_steps == 3
    # As the form sends it: every block whole, the overrides on top
    given = {**dict(load_params("tiny")), "overrides": ["sft.max_steps=3", "data.preference.split=test"]}
    made = from_flow_parameters(PipelineParams, given)
    assert made.sft.max_steps == 3 and made.data.preference.split == "test"
    with pytest.raises(ValueError, match="expected key.path=value"):
        load_params("tiny", overrides=["overrides=[sft.max_steps]"])


def test_prefect_yaml_describes_the_served_deployments_names_tags_version_triggers_and_limit():
    """deployments/prefect.yaml (for `prefect deploy`) and `rlhf serve`/`rlhf deploy` (deployments/serve.py) describe
    one set of deployments: the same names, entrypoints, descriptions, tags, version, schedule, trigger and concurrency
    limit."""
    import yaml
    from prefect.deployments.runner import EntrypointType

    from rlhf_pipeline.deployments.serve import RETRAIN_CRON, deployment_version
    from tests.deployments.servers import ROOT

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    written = {d["name"]: d for d in spec["deployments"]}
    served = {d.name: d for d in deployments(entrypoint_type=EntrypointType.MODULE_PATH)}  # as `rlhf deploy` makes them
    assert sorted(written) == sorted(served)
    [step] = spec["build"]
    version_step = step["prefect.deployments.steps.run_shell_script"]
    script = version_step["script"].removeprefix('python -c "').removesuffix('"')
    assert script == "from rlhf_pipeline.deployments.serve import deployment_version; print(deployment_version())"
    for name, entry in written.items():
        made = served[name]
        assert entry["entrypoint"] == made.entrypoint, name
        assert " ".join(entry["description"].split()) == made.description, name
        assert entry["tags"] == made.tags and made.tags[0] == "rlhf", name
        assert entry["version"] == "{{ %s.stdout }}" % version_step["id"] and made.version == deployment_version()
        assert [s["cron"] for s in entry.get("schedules", [])] == [s.schedule.cron for s in made.schedules], name
        triggers = [
            {**t, "description": " ".join(t["description"].split()), "expect": set(t["expect"])}
            for t in entry.get("triggers", [])
        ]
        assert triggers == [
            t.model_dump(include={"name", "description", "expect", "match"}, mode="python") for t in made.triggers
        ], name
        limit = entry.get("concurrency_limit")
        options = made.concurrency_options
        assert (limit or None) == (
            {"limit": made.concurrency_limit, "collision_strategy": options.collision_strategy.value}
            if options
            else None
        ), name
    assert written["retrain"]["parameters"]["algorithm"] == "ppo" and served["retrain"].tags == [
        "rlhf",
        "ppo",
        "retrain",
    ]
    assert served["retrain"].schedules[0].schedule.cron == RETRAIN_CRON


def test_retrain_runs_one_at_a_time_and_on_the_data_event_as_configured():
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    for collision, strategy in (
        ("queue", ConcurrencyLimitStrategy.ENQUEUE),
        ("cancel", ConcurrencyLimitStrategy.CANCEL_NEW),
    ):
        made = {d.name: d for d in deployments(retrain_collision=collision)}
        assert (
            made["retrain"].concurrency_limit == 1
            and made["retrain"].concurrency_options.collision_strategy == strategy
        )
        assert all(d.concurrency_limit is None for name, d in made.items() if name != "retrain")
        [trigger] = made["retrain"].triggers
        assert trigger.expect == {"rlhf.data.updated"} and trigger.parameters is None
        assert trigger.match.model_dump() == {"prefect.resource.id": "rlhf.data.*"}
    with pytest.raises(ValueError, match="retrain_collision='drop': expected one of queue, cancel"):
        deployments(retrain_collision="drop")
