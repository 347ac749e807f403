"""Running the rlhf flow in tests and reading back its Prefect task states."""

from __future__ import annotations

from rlhf_pipeline.flows.params import load_params

FAST = [
    "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=2",
    "model.tiny.num_attention_heads=2",
    "sft.max_steps=8", "rm.max_steps=4", "dpo.max_steps=4",
    "sft.logging_steps=2", "rm.logging_steps=2", "dpo.logging_steps=2",
    "eval.max_prompts=20", "eval.max_new_tokens=8",
]  # fmt: skip
STAGES = ["data", "sft", "rm", "dpo", "eval"]


def run(*overrides: str):
    from rlhf_pipeline.flows.rlhf import rlhf

    params = load_params("tiny", [*FAST, *overrides])
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
