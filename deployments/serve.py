"""Serve the pipeline as Prefect deployments: `rlhf/full` (ppo), one per other algorithm of the table of
stages (`rlhf/dpo`, `rlhf/kto`, `rlhf/orpo`, `rlhf/grpo`, `rlhf/rloo`), `rlhf/retrain` and `rlhf-eval/eval`.

    prefect server start --host 127.0.0.1          # one terminal
    rlhf serve                                     # another (PREFECT_API_URL=http://127.0.0.1:4200/api)
    prefect deployment run rlhf/full -p ppo='{"kl_coef": 0.1}'

Every deployment carries the whole resolved parameter set of its preset, so
the UI form opens filled in, with every field typed, bounded and described
(`enforce_parameter_schema`). A run's block (`-p ppo=...`) replaces the
deployment's block, and the flow merges it field by field onto the preset.
`deployments/prefect.yaml` describes the same deployments for work pools
(tests/deployments/test_serve.py holds the two in agreement).

Every deployment is tagged `rlhf` and its algorithm and carries the package version (with the checkout's commit).
`rlhf/retrain` runs on its cron and whenever `rlhf.data.updated` arrives for a resource `rlhf.data.<name>`
(`prefect event emit rlhf.data.updated --resource-id rlhf.data.preference`), with the deployment's parameters;
one retrain runs at a time: another one waits for it (`queue`) or is cancelled (`cancel`).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_pipeline.flows.params import DEFAULT_PRESET, load_params
from rlhf_pipeline.tasks.orchestration.events import DATA_EVENT, DATA_RESOURCE
from rlhf_pipeline.tasks.stages import ALGORITHMS

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

RETRAIN_CRON = "0 3 * * 1"  # Mondays 03:00: weekly retraining on the newest data
RETRAIN_COLLISIONS = {"queue": "ENQUEUE", "cancel": "CANCEL_NEW"}
"""What a retrain that finds one running does (`--retrain-collision`): Prefect's collision strategies of a deployment
concurrency limit. `queue`: it waits (state AwaitingConcurrencySlot) and runs after; `cancel`: it is cancelled."""
RETRAIN_TRIGGER = {
    "name": "rlhf/retrain on rlhf.data.updated",
    "description": "Retrain when an ingest job or labelling tool announces new data "
    "(`prefect event emit rlhf.data.updated --resource-id rlhf.data.<name>`).",
    "expect": [DATA_EVENT],
    "match": {"prefect.resource.id": f"{DATA_RESOURCE}*"},
}
"""The retrain deployment's event trigger (prefect.yaml's `triggers:` entry says the same). No parameters: a
triggered run takes the deployment's, which point at the data that grows (`--retrain-set`)."""


@functools.cache
def deployment_version() -> str:
    """The package version, with the commit of the checkout it runs from (`0.1.0+g1a2b3c4`); the version alone from
    an installed wheel (this file is then tracked by no repository)."""
    from importlib.metadata import version

    here = Path(__file__).resolve()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(here.parent), *args], capture_output=True, text=True, timeout=5)

    try:  # a wheel in a virtualenv inside some repository is no checkout of ours: this file must be tracked
        tracked = git("ls-files", "--error-unmatch", here.name).returncode == 0
        commit = git("rev-parse", "--short", "HEAD").stdout.strip() if tracked else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version('rlhf-pipeline')}+g{commit}" if commit else version("rlhf-pipeline")


def tags(algorithm: str, *more: str) -> list[str]:
    return ["rlhf", algorithm, *more]


def deployments(
    preset: str = DEFAULT_PRESET,
    retrain_cron: str = RETRAIN_CRON,
    retrain_overrides: list[str] = (),
    retrain_collision: str = "queue",
    **where,
) -> list[RunnerDeployment]:
    """The deployments; `retrain_overrides` (`data.preference.path=/data/prefs/*.jsonl`...) point retraining at fresh
    data; `retrain_collision` (`queue`, `cancel`) says what a retrain that finds one running does; `where` goes to every
    `Flow.to_deployment` (a work pool: `deploy`)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.events import DeploymentEventTrigger

    from rlhf_pipeline.flows.evaluate import rlhf_eval
    from rlhf_pipeline.flows.rlhf import rlhf

    if retrain_collision not in RETRAIN_COLLISIONS:
        raise ValueError(f"retrain_collision={retrain_collision!r}: expected one of {', '.join(RETRAIN_COLLISIONS)}")
    version = deployment_version()

    def pipeline(name: str, overrides: list[str] = (), algorithm: str = "ppo", **options) -> RunnerDeployment:
        params = load_params(preset, overrides, algorithm=algorithm)
        options.setdefault("tags", tags(algorithm))
        made = rlhf.to_deployment(
            name=name, parameters=params.model_dump(mode="json"), version=version, **options, **where
        )
        return leading_form(made, params)

    return [
        pipeline("full", description="data -> sft -> rm -> ppo -> eval -> registry (the classic RLHF recipe)."),
        *(
            pipeline(algorithm, algorithm=algorithm, description=f"The pipeline with {algorithm}.")
            for algorithm in ALGORITHMS
            if algorithm != "ppo"
        ),
        pipeline(
            "retrain",
            retrain_overrides,
            cron=retrain_cron,
            triggers=[DeploymentEventTrigger(**RETRAIN_TRIGGER)],
            concurrency_limit=ConcurrencyLimitConfig(
                limit=1, collision_strategy=ConcurrencyLimitStrategy(RETRAIN_COLLISIONS[retrain_collision])
            ),
            tags=tags("ppo", "retrain"),
            description="Scheduled retraining on the newest data (a path, glob or hub revision in `data`), and on "
            "each `rlhf.data.updated` event: unchanged stages are reused from the cache; promotion only through the "
            "registry gate. One at a time.",
        ),
        rlhf_eval.to_deployment(
            name="eval",
            parameters={"policy": "models:/rlhf-policy@candidate", "preset": preset},
            description="Evaluate a registered version (or a model folder) on demand.",
            tags=tags("eval"),
            version=version,
            **where,
        ),
    ]


FORM = {
    "model": ("name_or_path", "seed", "dtype"),
    "data": ("path",),
    "algorithm": (
        "max_steps",
        "total_episodes",
        "learning_rate",
        "beta",
        "kl_coef",
        "per_device_train_batch_size",
        "num_generations",
        "max_completion_length",
    ),
}
"""The fields the UI form shows of the blocks it shows (of `data`, each dataset's path; of the algorithm's block, those
of these it has); every other field is reached through `overrides`."""


def leading_form(deployment: RunnerDeployment, params) -> RunnerDeployment:
    """The deployment's form as a person fills it in: the algorithm, the preset, the run's name in MLflow, `overrides`
    (any other field, as `--set`), the model, the algorithm's block (and `rewards` for an online one) and the data,
    each block with the few fields most runs change (`FORM`). The blocks and fields not shown keep the deployment's
    values (the UI sends them back unchanged, and a run's block still merges field by field onto the preset); the
    flow validates every field as it does for `rlhf run`."""
    from rlhf_pipeline.tasks.stages import BY_NAME

    schema = deployment._parameter_openapi_schema
    algorithm = params.algorithm
    shown = [
        "algorithm",
        "preset",
        "experiment_name",
        "overrides",
        "model",
        algorithm,
        *(("rewards",) if BY_NAME[algorithm].online else ()),
        "data",
        "no_cache",
    ]
    # The other blocks stay parameters (`prefect deployment run -p sft=...` names them), last and with no field drawn.
    hidden = [name for name in schema.properties if name not in shown]
    for at, name in enumerate([*shown, *hidden]):
        schema.properties[name]["position"] = at
    for name in hidden:
        schema.properties[name]["title"] = f"{name} (its fields: through overrides)"
        _only(schema.definitions[_definition(schema.properties[name], name)], ())
    for block, fields in (("model", FORM["model"]), (algorithm, FORM["algorithm"])):
        hidden = _only(schema.definitions[_definition(schema.properties[block], block)], fields)
        if hidden:
            schema.properties[block]["description"] = (
                f"{schema.properties[block].get('description', '').rstrip()} Shown: the fields most runs change; "
                f"{len(hidden)} more through `overrides` (e.g. {block}.{hidden[0]}=...)."
            ).strip()
    _only(schema.definitions["DatasetSpec"], FORM["data"])
    return deployment


def _definition(prop: dict, block: str) -> str:
    """The name of the definition a block's property refers to."""
    for candidate in (prop, *prop.get("allOf", ()), *prop.get("anyOf", ())):
        if "$ref" in candidate:
            return candidate["$ref"].rsplit("/", 1)[-1]
    raise ValueError(f"the form's block {block!r} refers to no definition")


def _only(definition: dict, fields: tuple[str, ...]) -> list[str]:
    """Show only `fields` of a block's definition (in that order); returns the others. They stay in the values the form
    sends back: the definition admits them by name (`patternProperties`, which the form does not draw) and still
    refuses any other key, so a misspelt field is refused when the run is created; the flow checks their values."""
    import re

    properties = definition["properties"]
    definition["properties"] = {name: properties[name] for name in fields if name in properties}
    others = [name for name in properties if name not in definition["properties"]]
    if others:
        definition["patternProperties"] = {f"^({'|'.join(map(re.escape, others))})$": {}}
    definition.pop("required", None)
    return others


def serve(
    preset: str = DEFAULT_PRESET,
    retrain_cron: str = RETRAIN_CRON,
    retrain_overrides: list[str] = (),
    retrain_collision: str = "queue",
) -> None:
    from prefect import serve as prefect_serve

    from rlhf_pipeline.tasks.orchestration.stage_task import ensure_device_limit
    from rlhf_pipeline.tasks.tracking import client as tracking

    tracking.client()  # a SQLite store gets its tables now, before the runs served here (and their hooks) open it
    made = deployments(preset, retrain_cron, retrain_overrides, retrain_collision)
    ensure_device_limit()
    # SIGTERM must not pause the deployments (and with them the retrain schedule).
    prefect_serve(*made, pause_on_shutdown=False)


def deploy(
    pool: str,
    preset: str = DEFAULT_PRESET,
    retrain_cron: str = RETRAIN_CRON,
    retrain_overrides: list[str] = (),
    retrain_collision: str = "queue",
) -> list[str]:
    """Register the deployments `serve` serves on a work pool, for its workers to run: the same names, parameters and
    leading forms (`prefect deploy` with deployments/prefect.yaml builds each form from the flow's signature, in
    signature order, and carries only `algorithm` and `preset`). Entrypoints are module paths of the installed package,
    so a worker needs no checkout. Returns the names registered."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import EntrypointType
    from prefect.exceptions import ObjectNotFound

    from rlhf_pipeline.deployments.env import WORKER_ENV
    from rlhf_pipeline.tasks.orchestration.stage_task import ensure_device_limit

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise ValueError(
                f"no work pool {pool!r} on {client.api_url}: `prefect work-pool create {pool} --type process` first"
            ) from None
    made = deployments(
        preset,
        retrain_cron,
        retrain_overrides,
        retrain_collision,
        work_pool_name=pool,
        job_variables={"env": WORKER_ENV},
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    ensure_device_limit()
    for deployment in made:
        deployment.apply()
    return [f"{deployment.flow_name}/{deployment.name}" for deployment in made]
