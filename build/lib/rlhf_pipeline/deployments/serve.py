"""Serve the pipeline as Prefect deployments: `rlhf/full` (ppo), one per other algorithm of the table of
stages (`rlhf/dpo`, `rlhf/kto`, `rlhf/grpo`, `rlhf/rloo`), `rlhf/retrain` and `rlhf-eval/eval`.

    prefect server start --host 127.0.0.1          # one terminal
    rlhf serve                                     # another (PREFECT_API_URL=http://127.0.0.1:4200/api)
    prefect deployment run rlhf/full -p ppo='{"kl_coef": 0.1}'

Every deployment carries the whole resolved parameter set of its preset, so
the UI form opens filled in, with every field typed, bounded and described
(`enforce_parameter_schema`). A run's block (`-p ppo=...`) replaces the
deployment's block, and the flow merges it field by field onto the preset.
`deployments/prefect.yaml` describes the same deployments for work pools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_pipeline.flows.params import DEFAULT_PRESET, load_params
from rlhf_pipeline.tasks.stages import ALGORITHMS

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

RETRAIN_CRON = "0 3 * * 1"  # Mondays 03:00: weekly retraining on the newest data


def deployments(preset: str = DEFAULT_PRESET, retrain_cron: str = RETRAIN_CRON, retrain_overrides: list[str] = ()) -> list[RunnerDeployment]:
    """The deployments; `retrain_overrides` (`data.preference.path=/data/prefs/*.jsonl`...) point retraining at fresh data."""
    from rlhf_pipeline.flows.evaluate import rlhf_eval
    from rlhf_pipeline.flows.rlhf import rlhf

    def params(overrides: list[str] = (), **fields) -> dict:
        return load_params(preset, overrides, **fields).model_dump(mode="json")

    return [
        rlhf.to_deployment(
            name="full", parameters=params(algorithm="ppo"), description="data -> sft -> rm -> ppo -> eval -> registry (the classic RLHF recipe)."
        ),
        *(
            rlhf.to_deployment(name=algorithm, parameters=params(algorithm=algorithm), description=f"The pipeline with {algorithm}.")
            for algorithm in ALGORITHMS
            if algorithm != "ppo"
        ),
        rlhf.to_deployment(
            name="retrain",
            cron=retrain_cron,
            parameters=params(retrain_overrides, algorithm="ppo"),
            description="Scheduled retraining on the newest data (a path, glob or hub revision in `data`): "
            "unchanged stages are reused from the cache; promotion only through the registry gate.",
        ),
        rlhf_eval.to_deployment(
            name="eval",
            parameters={"policy": "models:/rlhf-policy@candidate", "preset": preset},
            description="Evaluate a registered version (or a model folder) on demand.",
        ),
    ]


def serve(preset: str = DEFAULT_PRESET, retrain_cron: str = RETRAIN_CRON, retrain_overrides: list[str] = ()) -> None:
    from prefect import serve as prefect_serve

    from rlhf_pipeline.tasks.orchestration import ensure_device_limit

    made = deployments(preset, retrain_cron, retrain_overrides)
    ensure_device_limit()
    # SIGTERM must not pause the deployments (and with them the retrain schedule).
    prefect_serve(*made, pause_on_shutdown=False)
