"""The MLflow parent run of one flow run: opened before the first stage, closed after the last."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from rlhf_pipeline.tasks.config import LaunchConfig
from rlhf_pipeline.tasks.orchestration.stage_task import coordinated, current_flow_run, ensure_device_limit, prefect_log
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, RunContext
from rlhf_pipeline.tasks.store.leases import release
from rlhf_pipeline.tasks.store.secrets import install_log_filter, redact, redact_text
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking.client import MODEL_LOGGED, MODEL_URI, POLICY_MODEL
from rlhf_pipeline.trainers.runtime.stopping import checkpoint_on_sigterm

_OPEN: dict[str, str] = {}
"""The flow runs this process is inside (`pipeline_run`), by Prefect flow run id: their MLflow parent runs."""


@dataclass
class PipelineRun:
    ctx: RunContext
    summary: dict = field(default_factory=dict)

    def finish(
        self,
        policy: ArtifactRef,
        report: ArtifactRef,
        stages: list[ArtifactRef],
        registered: dict | None = None,
        states: dict[str, str] | None = None,
    ) -> dict:
        """Log the evaluation to the parent run and link the policy's weights (its logged model: no second copy); return
        where everything is (`stages`: each one's state in this run, e.g. Cached, given in `states`, and the seconds
        its build took)."""
        run_id = self.ctx.parent_run_id
        metrics = report.manifest()["metrics"]
        tracking.log_metrics(run_id, metrics)
        tracking.log_artifacts(run_id, report.path / "summary.md", "eval")
        tags = {"rlhf.policy": policy.uri, "rlhf.policy_stage": policy.stage, "rlhf.policy_digest": policy.digest}
        if model_id := tracking.find_logged_model(policy.digest):  # its stage's logged model: a link, no copy
            tags[MODEL_URI] = tracking.logged_model(model_id).artifact_location
            tags[POLICY_MODEL] = model_id
        elif earlier := tracking.find_run(  # a policy with no logged model in this store: weights once per policy
            self.ctx.experiment_id, {"rlhf.policy_digest": policy.digest, MODEL_LOGGED: "true"}
        ):
            tags[MODEL_URI] = tracking.artifact_uri(earlier, "model")  # the same bytes: a link, not another copy
        else:
            tracking.log_artifacts(run_id, policy.path / "model", "model")
            tags[MODEL_LOGGED] = "true"
        tracking.set_tags(run_id, tags)
        self.summary = {
            "mlflow_run_id": run_id,
            "mlflow": tracking.run_link(run_id),
            "tracking_uri": tracking.shown_uri(),
            "artifacts": {ref.stage: ref.uri for ref in stages},
            "metrics": metrics,
            "registry": registered,
            "stages": {
                ref.stage: {"state": (states or {}).get(ref.stage), "seconds": _build_seconds(ref)} for ref in stages
            },
            "warnings": json.loads((report.path / "summary.json").read_text()).get("warnings", [])
            if (report.path / "summary.json").is_file()
            else [],
        }
        return self.summary


class _ThreadTimeoutWarning(logging.Filter):
    """Prefect 3.9.1 warns, for every task with `timeout_seconds` that runs in a worker thread, that the timeout cannot
    interrupt a blocking call. Every stage has one (`retry.timeout_seconds`) and runs in a worker thread; the timeout
    reaches it between training steps, and the launcher polls its ranks every 0.5 s (tests/scenarios/test_faults.py), so
    the warning, on every stage of every run, says nothing that applies here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout of %s seconds configured for this task, but the task is running")


def quiet_thread_timeout_warning() -> None:
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _ThreadTimeoutWarning) for f in logger.filters):
        logger.addFilter(_ThreadTimeoutWarning())


@contextlib.contextmanager
def pipeline_run(params: Any) -> Iterator[PipelineRun]:
    """`params`: the run's `PipelineParams` (or `EvalParams`)."""
    tracking.check_reachable()
    flow_run_id, flow_run_name = current_flow_run()
    if flow_run_id and coordinated():
        ensure_device_limit()
    experiment = tracking.experiment_id(params.experiment_name)
    run_id = tracking.start_run(
        experiment, flow_run_name, {"prefect.flow_run_id": flow_run_id, "rlhf.algorithm": params.algorithm}
    )
    install_log_filter()
    quiet_thread_timeout_warning()
    config = redact(params.model_dump(mode="json"))
    tracking.log_params(run_id, config)
    tracking.log_text(run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")
    ctx = RunContext(
        artifact_root=str(tracking.state_dir() / "artifacts"),
        experiment_id=experiment,
        parent_run_id=run_id,
        force=params.no_cache,
        launch=getattr(params, "launch", LaunchConfig()),  # the rlhf-eval flow trains nothing: it has no launch block
        wait_seconds=params.retry.timeout_seconds if hasattr(params, "retry") else None,
        stall_seconds=params.retry.stall_seconds if hasattr(params, "retry") else None,
    )
    prefect_log(f"MLflow: {tracking.run_link(run_id)}")
    prefect_log(f"Artifacts: {ctx.artifact_root}")
    if flow_run_id:
        _OPEN[flow_run_id] = run_id
    try:
        # SIGTERM (an eviction, a preemption, Prefect's cancel): every training stage checkpoints and stops first.
        with checkpoint_on_sigterm():
            yield PipelineRun(ctx)
    except BaseException as exc:
        tracking.set_tags(run_id, {"rlhf.error": f"{type(exc).__name__}: {exc}"})
        tracking.end_run(run_id, failed=True)
        raise
    finally:
        _OPEN.pop(flow_run_id or "", None)
        release(Path(ctx.artifact_root), run_id)  # gc may remove what this run built or reused
    tracking.end_run(run_id)


def open_runs() -> dict[str, str]:
    """The flow runs this process is inside now, by Prefect flow run id, with their MLflow parent runs."""
    return dict(_OPEN)


def cancel_runs(runs: dict[str, str], reason: str) -> list[str]:
    """`runs` (from `open_runs`) end Cancelled, as a person stopping them expects (Ctrl-C): in Prefect the flow run
    and its task runs still running or waiting, forced past whatever state the flow reached meanwhile; in MLflow the
    parent run KILLED and its stage runs still RUNNING too, tagged with `reason`. Each store is tried on its own, so
    one that does not answer does not keep the other's record. Returns the flow run names."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    names = []
    for flow_run_id, run_id in runs.items():
        with contextlib.suppress(Exception):
            mlflow = tracking.client()
            experiment = mlflow.get_run(run_id).info.experiment_id
            running = mlflow.search_runs(
                [experiment], f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'"
            )
            for stopped in [run_id, *(stage_run.info.run_id for stage_run in running)]:
                mlflow.set_tag(stopped, "rlhf.error", f"Cancelled: {reason}")
                mlflow.set_terminated(stopped, status="KILLED")
        with contextlib.suppress(Exception), get_client(sync_client=True) as client:
            unfinished = [StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.PAUSED]
            for task_run in client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter(state=dict(type=TaskRunFilterStateType(any_=unfinished))),
            ):
                client.set_task_run_state(task_run.id, Cancelled(message=reason), force=True)
            client.set_flow_run_state(flow_run_id, Cancelled(message=reason), force=True)
            names.append(client.read_flow_run(flow_run_id).name)
    return names


def preset_label(preset: str | None) -> str:
    """A preset as a run name shows it: `tiny`, `ci` for `tests/ci.yaml`, `defaults` for none."""
    from pathlib import Path

    return Path(preset).stem if preset else "defaults"


def model_label(source: str) -> str:
    """A model source as a run name shows it: `rlhf-policy@candidate` for `models:/rlhf-policy@candidate`, a folder
    by its name (a stage's `model/` folder by the folder above it)."""
    from pathlib import PurePath

    if source.startswith("models:/"):
        return source.removeprefix("models:/")
    folder = PurePath(source.rstrip("/"))
    return (folder.parent.name if folder.name == "model" else folder.name) or source


def find_parent_run(flow_run_id: str, experiment_name: str) -> str | None:
    """The MLflow parent run that `pipeline_run` opened for this flow run (tag `prefect.flow_run_id`), or None."""
    experiment = tracking.client().get_experiment_by_name(experiment_name)  # looked up, never created here
    if experiment is None:
        return None
    return tracking.find_run(experiment.experiment_id, {"prefect.flow_run_id": flow_run_id})


def report_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (`on_failure`, `on_crashed`): name where a person looks, the run's MLflow parent run (its id and link)
    and the state folder, in the flow run's Prefect log and on stdout. A crashed run never closed its MLflow run: it is
    marked failed here. Runs in the flow's process (failed) or in the serve/worker process (crashed)."""
    from prefect.logging.loggers import flow_run_logger

    experiment_name = (flow_run.parameters or {}).get("experiment_name") or "rlhf"
    state_folder = tracking.state_dir()
    try:
        # A server that does not answer fails here in seconds; MLflow's own client retries for ~4 minutes first.
        tracking.check_reachable()
        run_id = find_parent_run(str(flow_run.id), experiment_name)
        if run_id is None:
            mlflow = f"no MLflow run was opened (experiment {experiment_name!r} in {tracking.shown_uri()})"
        else:
            mlflow = f"MLflow parent run {run_id}: {tracking.run_link(run_id)}"
            if state.is_crashed() and tracking.run_status(run_id) == "RUNNING":
                tracking.set_tags(run_id, {"rlhf.error": f"Crashed: {state.message}"})
                tracking.end_run(run_id, failed=True)
    except Exception as exc:  # the hook must still name the state folder when MLflow does not answer
        mlflow = f"the MLflow run could not be looked up ({type(exc).__name__}: {exc}) in {tracking.shown_uri()}"
    message = redact_text(
        f"{flow.name} run {flow_run.name!r} {state.name}: {mlflow}; state folder {state_folder} (stage artifacts in "
        f"{state_folder / 'artifacts'}, checkpoints of unfinished stages in artifacts/<stage>/.work/)"
    )
    flow_run_logger(flow_run, flow).error(message)
    print(message, flush=True)


def _build_seconds(ref: ArtifactRef) -> float | None:
    """How long the stage's build took, from its manifest (a registry model folder or a hub model has none)."""
    manifest = ref.path / "manifest.json"
    return json.loads(manifest.read_text()).get("resources", {}).get("seconds") if manifest.is_file() else None
