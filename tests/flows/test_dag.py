"""The flow-run graph the Prefect UI draws: every stage a top-level node, with its upstream edges (issue 16)."""

from __future__ import annotations

import pytest

from tests.flows.helpers import run

pytestmark = pytest.mark.e2e  # a pipeline run end to end: the fast loop skips it (-m 'not e2e')

UPSTREAM = {  # the default run (dpo): each stage's upstream stages, as data flows between them
    "data": set(),
    "sft": {"data"},
    "rm": {"data", "sft"},
    "dpo": {"data", "sft", "rm"},
    "eval": {"data", "sft", "rm", "dpo"},
    "registry": {"data", "sft", "rm", "dpo", "eval"},
}


def graph_of(flow_run_id) -> dict:
    """The flow run's graph as the UI reads it (`GET /flow_runs/{id}/graph-v2`)."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        response = client.request("GET", "/flow_runs/{id}/graph-v2", path_params={"id": flow_run_id})
        response.raise_for_status()
        return response.json()


def data_running_before_the_next_submission(monkeypatch) -> None:
    """As under a real server, where each submission is an API call: the data stage is running by the time the flow submits the
    stages after it (a test server is quick enough to submit them all before it starts)."""
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


def test_every_stage_is_a_top_level_node_with_its_upstream_edges(prefect, state, monkeypatch):
    data_running_before_the_next_submission(monkeypatch)
    done = run()
    assert done.is_completed(), done.message
    graph = graph_of(done.state_details.flow_run_id)
    nodes = {node["id"]: node for _, node in graph["nodes"]}
    label = {node_id: node["label"] for node_id, node in nodes.items()}
    assert sorted(label.values()) == sorted(UPSTREAM)
    for node in nodes.values():
        # `encapsulating` puts a node inside another's collapsed group: Prefect infers it from a parameter that is a running task's future
        assert node["encapsulating"] == [], (node["label"], [label[e["id"]] for e in node["encapsulating"]])
        parents = {label[edge["id"]] for edge in node["parents"]}
        # Each stage also waits for the one before it (one stage on the device at a time): that edge is among these.
        assert parents == UPSTREAM[node["label"]], node["label"]
    roots = {label[node_id] for node_id in graph["root_node_ids"]}
    assert roots == {"data"}
