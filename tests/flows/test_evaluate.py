"""The report a person reads, and the on-demand `rlhf-eval` flow on a registered version."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from rlhf_pipeline.flows.evaluate import rlhf_eval
from tests.flows.helpers import DPO_RUN_STAGES, assert_a_flat_graph, graph_of, run, task_states

pytestmark = pytest.mark.slow  # a pipeline run end to end: the fast loop skips it (-m 'not slow')


def prefect_artifacts(flow_state) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_state.state_details.flow_run_id])
            )
        )
    return {a.key: a for a in found}


def test_report_artifacts_and_on_demand_evaluation_of_the_champion(prefect, state):
    trained = run("registry.model_name=eval-flow-test")
    assert trained.is_completed(), trained.message
    summary = trained.result()
    assert summary["registry"]["promoted"]  # the first version becomes champion
    # The registry's parameters are eval's and dpo's futures: it starts on the runner's one thread as eval ends, and is
    # still a node of its own, not eval's child (`stage_task.stage_runner`).
    assert_a_flat_graph(graph_of(trained.state_details.flow_run_id), [*DPO_RUN_STAGES, "registry"])

    artifacts = prefect_artifacts(trained)
    markdown = artifacts["rlhf-eval-summary"].data
    exact = summary["metrics"]["eval/heldout/policy_exact_match"]
    assert f"| `eval/heldout/policy_exact_match` | {exact:.4f} |" in markdown
    assert "win_rate_vs_sft" in markdown and summary["mlflow_run_id"] in markdown
    assert "rlhf-eval-samples" in artifacts
    from mlflow.tracking import MlflowClient

    logged = {a.path for a in MlflowClient().list_artifacts(summary["mlflow_run_id"], "eval")}
    assert "eval/samples_table.json" in logged and "eval/summary.md" in logged
    plots = {a.path for a in MlflowClient().list_artifacts(summary["mlflow_run_id"], "plots")}
    assert {
        "plots/win_rates.png",
        "plots/reward_distributions.png",
        "plots/exact_match.png",
        "plots/training_curves.png",
    } <= plots

    on_demand = rlhf_eval(
        policy="models:/eval-flow-test@champion",
        eval={"max_prompts": 20, "max_new_tokens": 8},
        return_state=True,
    )
    assert on_demand.is_completed(), on_demand.message
    result = on_demand.result()
    # Same model, same held-out prompts, same greedy decoding: same score.
    assert result["metrics"]["eval/heldout/policy_exact_match"] == exact
    assert set(task_states(on_demand)) == {"data", "eval"}

    # The same evaluation as a person starts it: `rlhf eval`, a process of its own with its own temporary server.
    command = [
        "eval",
        "models:/eval-flow-test@champion",
        "--set",
        "eval.max_prompts=20",
        "--set",
        "eval.max_new_tokens=8",
    ]
    environment = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline", *command], env=environment, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("== finished ==") :].splitlines()
    states = {line.split()[0]: line.split()[1] for line in table[3:] if len(line.split()) > 2}
    assert states["data"] == "Cached" and states["eval"] == "Cached", table  # the report on_demand made
    assert states["sft"] == states["dpo"] == "input", table
    [policy] = [line for line in table if line.startswith("exact match: policy")]
    assert f"{exact:8.3f}" in policy, policy
