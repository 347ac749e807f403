"""Running the rlhf flow in tests and reading back its Prefect task states."""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.flows.params import load_params

CI_PRESET = str(Path(__file__).resolve().parents[1] / "ci.yaml")  # the tiny default, shrunk to seconds
STAGES = ["data", "sft", "rm", "dpo", "eval"]


def run(*overrides: str):
    from rlhf_pipeline.flows.rlhf import rlhf

    params = load_params(CI_PRESET, list(overrides))
    return rlhf(**dict(params), return_state=True)


def task_runs(flow_run_id, client=None) -> list:
    """The task runs of a flow run, read through `client` (default: the current Prefect API)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    if client is None:
        with get_client(sync_client=True) as client:
            return task_runs(flow_run_id, client)
    return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def task_states(flow_state) -> dict[str, str]:
    return {r.name: r.state.name for r in task_runs(flow_state.state_details.flow_run_id)}
