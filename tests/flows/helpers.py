"""Running the rlhf flow in tests and reading back its Prefect task states."""

from __future__ import annotations

from rlhf_pipeline.flows.params import load_params
from tests.helpers import CI_PRESET

DPO_RUN_STAGES = ["data", "sft", "rm", "dpo", "eval"]


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


def building_threads(monkeypatch) -> dict[str, int]:
    """Record the thread each stage builds on (stage -> `threading.get_ident()`), filled in as the flow runs."""
    import threading

    import rlhf_pipeline.tasks.store.stage as store

    threads: dict[str, int] = {}
    real = store._build

    def recording(entry, *args, **kwargs):
        threads[entry.stage] = threading.get_ident()
        return real(entry, *args, **kwargs)

    monkeypatch.setattr(store, "_build", recording)
    return threads


# --- the flow-run graph the Prefect UI draws (issue 16) ---------------------------------------------------------------


def upstream(policy: str = "dpo") -> dict[str, set[str]]:
    """Each stage's upstream stages in a run of `policy`, as data flows between them (registry: when enabled)."""
    order = ["data", "sft", "rm", policy, "eval", "registry"]
    return {stage: set(order[:position]) for position, stage in enumerate(order)}


def graph_of(flow_run_id) -> dict:
    """The flow run's graph as the UI reads it (`GET /flow_runs/{id}/graph-v2`)."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        response = client.request("GET", "/flow_runs/{id}/graph-v2", path_params={"id": flow_run_id})
        response.raise_for_status()
        return response.json()


def data_running_before_the_next_submission(monkeypatch) -> None:
    """As under a real server, where each submission is an API call: the data stage is running by the time the flow
    submits the stages after it (a test server is quick enough to submit them all before it starts)."""
    import time

    import rlhf_pipeline.flows.rlhf as flow_module

    real = flow_module.retrying

    def retrying(config):
        def options(task):
            configured = real(config)(task)
            if configured.name != "data":
                return configured
            submit = configured.submit

            def submit_and_wait(*args, **kwargs):
                future = submit(*args, **kwargs)
                deadline = time.monotonic() + 30
                while not (future.state.is_running() or future.state.is_final()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert future.state.is_running(), future.state  # still running while the rest are submitted
                return future

            configured.submit = submit_and_wait
            return configured

        return options

    monkeypatch.setattr(flow_module, "retrying", retrying)


def assert_a_flat_graph(graph: dict, stages: list[str], policy: str = "dpo") -> None:
    """Every stage a top-level node of the flow-run graph (`graph_of`; none inside another's collapsed group), with its
    upstream edges; `data` the only root. Each stage also waits for the one before it (one on the device at a time):
    among these."""
    nodes = {node["id"]: node for _, node in graph["nodes"]}
    label = {node_id: node["label"] for node_id, node in nodes.items()}
    assert sorted(label.values()) == sorted(stages)
    for node in nodes.values():
        # `encapsulating` puts a node inside another's group: Prefect infers it from a parameter that is a running
        # task's future
        assert node["encapsulating"] == [], (node["label"], [label[e["id"]] for e in node["encapsulating"]])
        assert {label[edge["id"]] for edge in node["parents"]} == upstream(policy)[node["label"]] & set(stages), node[
            "label"
        ]
    assert {label[node_id] for node_id in graph["root_node_ids"]} == {"data"}
