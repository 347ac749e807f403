"""Prefect events the pipeline emits and reacts to, so automations can follow the registry and the data.

Emitted by the `registry` task (`announce`):
- `rlhf.model.candidate`: a run's policy took the alias `candidate`;
- `rlhf.model.promoted`: the alias `champion` moved to it.
Both concern the resource `mlflow.model.<registered name>` (labels `version` and `alias`); the payload holds the
version, the gate's reason, the gate's metrics and the MLflow parent run. Prefect adds the flow run, task run,
flow, deployment and tags as related resources.

Received: `rlhf.data.updated`, emitted by an ingest job or a labelling tool when new data lands
(`prefect event emit rlhf.data.updated --resource-id rlhf.data.<name>`); the served `rlhf/retrain` deployment has a
trigger on it (`deployments/serve.py`).
"""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.tasks.gate import CANDIDATE, CHAMPION

CANDIDATE_EVENT, PROMOTED_EVENT, DATA_EVENT = "rlhf.model.candidate", "rlhf.model.promoted", "rlhf.data.updated"
MODEL_RESOURCE, DATA_RESOURCE = "mlflow.model.", "rlhf.data."
"""Resource id prefixes: a registered model (`mlflow.model.rlhf-policy`), a dataset (`rlhf.data.preference`)."""


def model_resource(model_name: str, version: str, alias: str) -> dict[str, str]:
    return {
        "prefect.resource.id": f"{MODEL_RESOURCE}{model_name}",
        "prefect.resource.name": model_name,
        "version": str(version),
        "alias": alias,
    }


def gate_metrics(gate_metric: str | None, metrics: dict[str, float]) -> dict[str, float]:
    """The gate's metric and its 95% bounds, as the eval stage reported them."""
    if not gate_metric:
        return {}
    names = (gate_metric, f"{gate_metric}_low", f"{gate_metric}_high")
    return {name: float(metrics[name]) for name in names if name in metrics}


def announce(outcome: dict[str, Any], gate_metric: str | None, metrics: dict[str, float], run_id: str) -> list[str]:
    """Emit `rlhf.model.candidate` for the registry's outcome and, when `champion` moved to the version,
    `rlhf.model.promoted`. Returns the names of the events sent: none without a Prefect API (Prefect would start a
    temporary server of its own to receive them)."""
    from prefect.events import emit_event
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return []

    version, previous = str(outcome["version"]), outcome.get("previous_champion")
    payload = {
        "version": version,
        "promoted": bool(outcome["promoted"]),
        "reason": outcome["reason"],
        "previous_champion": previous,
        "gate_metric": gate_metric,
        "metrics": gate_metrics(gate_metric, metrics),
        "mlflow_run_id": run_id,
    }
    sent = []
    name = outcome["model_name"]
    if emit_event(CANDIDATE_EVENT, model_resource(name, version, CANDIDATE), payload=payload) is not None:
        sent.append(CANDIDATE_EVENT)
    if outcome["promoted"] and previous != version:  # "already champion" moves nothing
        if emit_event(PROMOTED_EVENT, model_resource(name, version, CHAMPION), payload=payload) is not None:
            sent.append(PROMOTED_EVENT)
    return sent
