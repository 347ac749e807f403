"""Serve the pipeline as Prefect deployments: `rlhf/full`, `rlhf/dpo`, `rlhf/grpo`, `rlhf/rloo`, `rlhf/retrain`, `rlhf-eval/eval`.

    prefect server start --host 127.0.0.1          # one terminal
    rlhf serve                                     # another (PREFECT_API_URL=http://127.0.0.1:4200/api)
    prefect deployment run rlhf/full -p params='{"ppo": {"kl_coef": 0.1}}'

Every deployment carries the whole resolved parameter set of the tiny preset
(Prefect merges deployment parameters per top-level parameter, and the flow
has one: `params`), so the UI form opens filled in, with every field typed,
bounded and described (`enforce_parameter_schema`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flows.params import DEFAULT_PRESET, load_params

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

RETRAIN_CRON = "0 3 * * 1"  # Mondays 03:00: weekly retraining on the newest data


def deployments(preset: str = DEFAULT_PRESET, retrain_cron: str = RETRAIN_CRON) -> list[RunnerDeployment]:
    from flows.evaluate import rlhf_eval
    from flows.rlhf import rlhf

    def params(**fields) -> dict:
        return {"params": load_params(preset, **fields).model_dump(mode="json")}

    made = [
        rlhf.to_deployment(name="full", parameters=params(algorithm="ppo"), description="data -> sft -> rm -> ppo -> eval -> registry (the classic RLHF recipe)."),
        *(
            rlhf.to_deployment(name=algorithm, parameters=params(algorithm=algorithm), description=f"The pipeline with {algorithm}.")
            for algorithm in ("dpo", "grpo", "rloo")
        ),
        rlhf.to_deployment(
            name="retrain",
            cron=retrain_cron,
            parameters=params(algorithm="ppo"),
            description="Scheduled retraining: unchanged stages are reused from the cache; promotion only through the registry gate.",
        ),
        rlhf_eval.to_deployment(
            name="eval",
            parameters={"params": {"policy": "models:/rlhf-policy@candidate"}},
            description="Evaluate a registered version (or a model folder) on demand.",
        ),
    ]
    return made


def serve(preset: str = DEFAULT_PRESET, retrain_cron: str = RETRAIN_CRON) -> None:
    from prefect import serve as prefect_serve

    # SIGTERM must not pause the deployments (and with them the retrain schedule).
    prefect_serve(*deployments(preset, retrain_cron), pause_on_shutdown=False)
