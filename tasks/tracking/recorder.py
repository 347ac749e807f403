"""The store's `Recorder` in MLflow: each stage build or reuse is a child run of the flow's parent run, with the
resolved config as params, the curve and final metrics, the manifest and reports as files, the model's lineage
(`tasks.tracking.lineage`) and its card (`tasks.tracking.cards`). The artifact store never waits on it where it cannot
answer (docs/ARCHITECTURE.md, "Artifacts and the cache key")."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, ContextManager

from rlhf_pipeline.tasks.store.artifacts import HISTORY, MANIFEST
from rlhf_pipeline.tasks.store.metric_queue import MetricQueue
from rlhf_pipeline.tasks.store.stage import Entry, Finals, Log
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking import lineage

REPLAY_SECONDS = 600.0
"""How long a finished stage waits for the tracking server to take the metrics it kept through an outage."""


class MlflowRecorder:
    """`tasks.store.stage.Recorder` on the tracking server `tasks.tracking.client` talks to."""

    def cached(self, entry: Entry, producer: str, curves: list, metrics: dict[str, float], log: Log) -> str:
        # The artifact store and the tracking store are independent: the producing run may live in another MLflow
        # store (MLFLOW_TRACKING_URI changed). Everything logged here comes from the artifact.
        found = tracking.run_exists(producer)
        tags = {**entry.tags, "rlhf.cached": "true", "rlhf.produced_by": producer}
        if not found:
            tags["rlhf.produced_by_missing"] = f"run {producer} is not in {tracking.shown_uri()}"
        run_id = tracking.start_run(entry.ctx.experiment_id, entry.stage, tags, entry.ctx.parent_run_id)
        tracking.log_params(run_id, entry.config)
        last = max((step for step, _ in curves), default=0)
        # The curves, so cached runs line up in MLflow's compare view, and the final metrics: in batches, not a call
        # per step (a real model's thousand steps would be a thousand calls).
        now = int(time.time() * 1000)
        tracking.log_metric_rows(run_id, [(now, values, step) for step, values in [*curves, (last, metrics)]])
        self._lineage(entry, run_id, metrics, last)
        tracking.end_run(run_id)
        # Published while MLflow was away: the producing run ends, pointing here.
        if found and tracking.run_status(producer) == "RUNNING":
            tracking.set_tags(producer, {"rlhf.recorded_by": run_id})
            tracking.end_run(producer)
            log(f"{entry.stage}: MLflow run {producer} ended; its artifact's full curve is in run {run_id}")
        where = f"MLflow run {producer}" if found else f"MLflow run {producer}, not in this tracking store"
        log(f"{entry.stage}: cached ({entry.final}, produced by {where})")
        return run_id

    def started(self, entry: Entry, log: Log) -> str:
        # Runs of this key still RUNNING belonged to a process that died (the caller holds the key's lock).
        for stale in tracking.end_stale_runs(entry.ctx.experiment_id, entry.key):
            log(f"{entry.stage}: marked MLflow run {stale} KILLED (its process died before finishing)")
        tags = {**entry.tags, "rlhf.cached": "false"}
        run_id = tracking.start_run(entry.ctx.experiment_id, entry.stage, tags, entry.ctx.parent_run_id)
        tracking.log_params(run_id, entry.config)  # the resolved config first, before anything can fail
        log(f"{entry.stage}: MLflow {tracking.run_link(run_id)}")
        return run_id

    def sink(self, run_id: str) -> Callable[[list], None]:
        return lambda rows: tracking.log_metric_rows(run_id, rows)

    def watching(self, run_id: str) -> ContextManager:
        return tracking.system_metrics(run_id)

    def describe(self, entry: Entry, folder: Path, metrics: dict[str, float]) -> None:
        from rlhf_pipeline.tasks.tracking.cards import write_card

        write_card(folder, entry.stage, entry.key, entry.config, entry.upstream, metrics)

    def published(self, entry: Entry, run_id: str, queue: MetricQueue, finals: Finals) -> None:
        """A tracking server that does not answer fails the attempt transiently: the retry finds the artifact and
        records it as a cached run (its curve read from the artifact's history)."""
        try:
            if unsent := queue.close(REPLAY_SECONDS):
                raise ConnectionError(f"MLflow has not taken {unsent} rows of metrics in {REPLAY_SECONDS:.0f}s")
            if finals.tags:
                tracking.set_tags(run_id, finals.tags)
            for name in (MANIFEST, *entry.log_files):
                _log_file(run_id, entry.final, name)
            tracking.log_metrics(run_id, finals.metrics, finals.step)  # the final values sit at the end of the curves
            self._lineage(entry, run_id, finals.metrics, finals.step)
            tracking.end_run(run_id)
        except Exception as exc:
            queue.abandon()
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ConnectionError(
                f"{entry.stage}: published at {entry.final}, but the MLflow run {run_id} could not be completed "
                f"({type(exc).__name__}: {first}); the curve is in the artifact's {HISTORY}, and the retry records the "
                "stage as cached"
            ) from exc

    def failed(self, entry: Entry, run_id: str, exc: BaseException, queue: MetricQueue, folder: Path, log: Log) -> None:
        """Never in the way of the error itself: with the tracking server down (the queue saw it), nothing waits on
        it, and a failure to record is only logged."""
        unsent = queue.close(0 if queue.down_since is not None else 30)
        queue.abandon()
        if unsent or queue.down_since is not None:
            log(
                f"{entry.stage}: MLflow is not answering; the failure is not recorded in run {run_id} (its error "
                "follows here)"
            )
            return
        try:
            for name in entry.log_files:  # a failed validation still leaves its report in MLflow
                _log_file(run_id, folder, name)
            tracking.set_tags(run_id, {"rlhf.error": f"{type(exc).__name__}: {exc}"})
            tracking.end_run(run_id, failed=True)
        except Exception as failed:
            why = f"{type(failed).__name__}: {failed}"
            log(f"{entry.stage}: could not record the failure in MLflow run {run_id} ({why})")

    @staticmethod
    def _lineage(entry: Entry, run_id: str, metrics: dict[str, float], step: int) -> None:
        ctx = entry.ctx
        lineage.record(run_id, ctx.experiment_id, entry.stage, entry.final, entry.upstream, entry.config, metrics, step)


MLFLOW = MlflowRecorder()
"""The recorder every task passes to `run_stage`."""


def _log_file(run_id: str, stage_dir: Path, name: str) -> None:
    """Log `stage_dir/name` (file or folder) at the same relative place in the MLflow run; nothing if the stage wrote
    none."""
    path = stage_dir / name
    if not path.exists():
        return
    target = name if path.is_dir() else (str(Path(name).parent) if "/" in name else None)
    tracking.log_artifacts(run_id, path, target)
