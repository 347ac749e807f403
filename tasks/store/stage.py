"""The artifact store: a stage's key, its atomic publish, the manifest-backed cache and its MLflow child run
(docs/ARCHITECTURE.md, "Artifacts and the cache key").

    <artifact_root>/<stage>/<key>/        published, `manifest.json` last (`tasks.store.artifacts`)
    <artifact_root>/<stage>/.work/<key>/  checkpoints while training (resume source)

The artifact store, not Prefect's result cache, decides whether a stage runs: Prefect cannot tell that a cached result
points at a deleted directory (docs/ARCHITECTURE.md, "Why stages are keyed here, not by Prefect's cache policies"), so
a stage whose manifest is present is reported as a `Cached` task state and one whose directory was deleted runs again.
This module knows nothing of Prefect: the caller passes what must be held while a stage builds (`hold`, a device slot).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Callable, ContextManager

from pydantic import BaseModel

from rlhf_pipeline.tasks.store.artifacts import (
    FILES,
    HISTORY,
    MANIFEST,
    ArtifactRef,
    Build,
    RunContext,
    StageOutcome,
    content_digest,
    damage,
    file_listing,
    read_history,
)
from rlhf_pipeline.tasks.store.code_version import code_version
from rlhf_pipeline.tasks.store.metric_queue import MetricQueue
from rlhf_pipeline.tasks.store.resources import PeakMemory, child_pids, frozen_heap, kill_process
from rlhf_pipeline.tasks.store.secrets import redact
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking import lineage
from rlhf_pipeline.trainers.algorithms.loop import OUTCOME, PEAK_GPU, last_checkpoint
from rlhf_pipeline.trainers.models.load import tokenizer_digest
from rlhf_pipeline.trainers.runtime import stopping
from rlhf_pipeline.trainers.runtime.failures import permanent_reason

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "great-expectations", "prefect", "mlflow")


def stage_key(
    stage: str, config: BaseModel | dict, upstream: dict[str, ArtifactRef], fingerprints: dict[str, str], code: str = ""
) -> str:
    """sha256 of the canonical JSON of everything that determines the stage's output."""
    payload = {
        "stage": stage,
        "config": config.model_dump(mode="json") if isinstance(config, BaseModel) else config,
        # Upstream outputs by content: identical bytes from another config (or a stricter
        # data check) are the same input. A ref without a digest counts by its key.
        "upstream": {name: ref.digest or ref.key for name, ref in sorted(upstream.items())},
        "fingerprints": dict(sorted(fingerprints.items())),
        "code": code,
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def run_stage(
    stage: str,
    config: BaseModel | dict,
    upstream: dict[str, ArtifactRef],
    ctx: RunContext,
    build: Build,
    fingerprints: dict[str, str] | None = None,
    log_files: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
    digest_of: tuple[str, ...] = (),
    parts: dict[str, str] | None = None,
    trainer: str | None = None,
    hold: Callable[[], ContextManager] = contextlib.nullcontext,
    extra_tags: dict[str, str] | None = None,
    system_metrics: bool = False,
) -> StageOutcome:
    """Publish `<root>/<stage>/<key>/` by running `build`, or reuse it when its manifest exists.

    `log_files` are paths inside the stage directory logged to the stage's MLflow
    run (reports, tables); a published `model/` becomes the run's MLflow logged model (`tasks.tracking.lineage`).
    `digest_of` names the paths dependents key on (default: every file), so a
    re-run that changes only a report (timestamps, a new rule) re-trains nothing.
    `parts` names paths whose digests are kept one by one (`ArtifactRef.select`).
    `trainer` is the module whose read_source (and imports) is the stage's code version;
    `hold()` is held while the build runs (the caller's device slot); `extra_tags` go on its MLflow run (e.g.
    `rlhf.round` of a feedback round); `system_metrics`: MLflow samples the machine while it builds (device stages).
    """
    fingerprints = fingerprints or {}
    check_tokenizers(stage, upstream)
    # Secrets are masked before anything is keyed, logged or written: a rotated token re-trains nothing.
    config_json = redact(config.model_dump(mode="json") if isinstance(config, BaseModel) else config)
    code = code_version(trainer)
    key = stage_key(stage, config_json, upstream, fingerprints, code)
    stage_root = Path(ctx.artifact_root) / stage
    final = stage_root / key
    ref = ArtifactRef(stage=stage, key=key, uri=str(final))
    tags = {"rlhf.stage": stage, "rlhf.key": key, "rlhf.artifact": str(final), **(extra_tags or {})}

    stage_root.mkdir(parents=True, exist_ok=True)
    # One builder per key: a second run with the same inputs waits here, then finds the manifest.
    with _key_lock(stage_root, key, stage, log, ctx.wait_seconds):
        if (final / MANIFEST).is_file() and not ctx.force and (why := damage(final)):
            # Never reused, never blocking its key: kept aside for a look, and built again.
            aside = final.with_name(f".damaged-{key}-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
            log(f"{stage}: {final} cannot be reused: {why}; moved to {aside.name} and built again")
        if (final / MANIFEST).is_file() and not ctx.force:
            manifest = ref.manifest()
            ref = ref.model_copy(update={"digest": manifest["digest"], "parts": manifest.get("parts", {})})
            producer = manifest["mlflow_run_id"]
            # The artifact store and the tracking store are independent: the producing run may live in
            # another MLflow store (MLFLOW_TRACKING_URI changed). Everything logged here comes from the artifact.
            found = tracking.run_exists(producer)
            cached_tags = {"rlhf.cached": "true", "rlhf.produced_by": producer}
            if not found:
                cached_tags["rlhf.produced_by_missing"] = f"run {producer} is not in {tracking.shown_uri()}"
            run_id = tracking.start_run(ctx.experiment_id, stage, {**tags, **cached_tags}, ctx.parent_run_id)
            tracking.log_params(run_id, config_json)
            curves = read_history(final)
            metrics = {**manifest["metrics"], **resource_metrics(stage, manifest.get("resources", {}))}
            last = max((step for step, _ in curves), default=0)
            # The curves, so cached runs line up in MLflow's compare view, and the final metrics: in batches, not a
            # call per step (a real model's thousand steps would be a thousand calls).
            now = int(time.time() * 1000)
            tracking.log_metric_rows(run_id, [(now, values, step) for step, values in [*curves, (last, metrics)]])
            lineage.record(run_id, ctx.experiment_id, stage, final, upstream, config_json, metrics, last)
            tracking.end_run(run_id)
            if found and tracking.run_status(producer) == "RUNNING":  # published while MLflow was away
                tracking.set_tags(producer, {"rlhf.recorded_by": run_id})
                tracking.end_run(producer)
                log(f"{stage}: MLflow run {producer} ended; its artifact's full curve is in run {run_id}")
            where = f"MLflow run {producer}" if found else f"MLflow run {producer}, not in this tracking store"
            log(f"{stage}: cached ({final}, produced by {where})")
            return StageOutcome(ref, cached=True, metrics=metrics, mlflow_run_id=run_id)

        work_dir = stage_root / ".work" / key
        for leftover in stage_root.glob(f".tmp-{key}-*"):  # half-built by a process that died
            shutil.rmtree(leftover, ignore_errors=True)
        # Runs of this key still RUNNING belonged to a process that died (we hold the key's lock).
        for stale in tracking.end_stale_runs(ctx.experiment_id, key):
            log(f"{stage}: marked MLflow run {stale} KILLED (its process died before finishing)")
        resume = last_checkpoint(work_dir)
        if resume:
            tags["rlhf.resumed_from"] = Path(resume).name
            log(f"{stage}: resuming from {resume}")
        run_id = tracking.start_run(ctx.experiment_id, stage, {**tags, "rlhf.cached": "false"}, ctx.parent_run_id)
        tracking.log_params(run_id, config_json)  # the resolved config first, before anything can fail
        log(f"{stage}: MLflow {tracking.run_link(run_id)}")
        tmp = stage_root / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        started = time.time()
        last_step = [0]

        work_dir.mkdir(parents=True, exist_ok=True)
        history = work_dir / HISTORY  # kept beside the checkpoints, so a resumed build keeps its early curve

        # Metrics go through a queue of their own: training never waits for the tracking server, and an outage
        # loses nothing (every row is in `history` first, and the queue sends the rest when MLflow answers again).
        queue = MetricQueue(lambda rows: tracking.log_metric_rows(run_id, rows), log, stage)

        def log_metrics(values: dict[str, float], step: int) -> None:
            last_step[0] = max(last_step[0], step)
            with open(history, "a") as f:
                f.write(json.dumps({"step": step, "metrics": values}) + "\n")
            queue.put(values, step)

        children_before = child_pids()
        published = False
        # A SIGTERM waits (its grace period) for the checkpoint and for the stop's record in MLflow.
        with stopping.training():
            try:
                monitored = tracking.system_metrics(run_id) if system_metrics else contextlib.nullcontext()
                with hold(), monitored, frozen_heap(), PeakMemory() as memory:
                    metrics = build(tmp, work_dir, log_metrics)
                if history.is_file():
                    shutil.copy(history, tmp / HISTORY)
                from rlhf_pipeline.tasks.tracking.cards import (
                    write_card,  # before the listing: the manifest vouches for it
                )

                write_card(tmp, stage, key, config_json, upstream, metrics)  # model/README.md, if it wrote a model
                files = file_listing(tmp)
                seconds = time.time() - started
                training = json.loads((tmp / OUTCOME).read_text()) if (tmp / OUTCOME).is_file() else None
                resources = memory.figures(training)
                resources = {"seconds": round(seconds, 3), "started": started, "finished": time.time(), **resources}
                if training:
                    training = {name: value for name, value in training.items() if name != PEAK_GPU}
                manifest = {
                    "stage": stage,
                    "key": key,
                    "config": config_json,
                    "upstream": {
                        name: {"stage": r.stage, "key": r.key, "digest": r.digest} for name, r in upstream.items()
                    },
                    "digest": content_digest(tmp, digest_of),
                    "parts": {
                        name: content_digest(tmp, (path,))
                        for name, path in (parts or {}).items()
                        if (tmp / path).exists()
                    },
                    "fingerprints": fingerprints,
                    "code_version": code,
                    "tokenizer": tokenizer_digest(tmp / "model"),
                    "training": training,
                    "versions": _versions(),
                    "metrics": metrics,
                    "mlflow_run_id": run_id,
                    "resources": resources,
                    FILES: files,
                }
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
                _publish(tmp, final)  # the work is safe from here on, whatever the tracking server does
                published = True
                metrics = {**metrics, **resource_metrics(stage, resources)}
                _record_in_mlflow(
                    run_id,
                    stage,
                    final,
                    queue,
                    metrics,
                    last_step[0],
                    log_files,
                    outcome_tags(stage, training, log),
                    lambda: lineage.record(
                        run_id, ctx.experiment_id, stage, final, upstream, config_json, metrics, last_step[0]
                    ),
                )
            except BaseException as exc:
                # A timed-out or failed build leaves no workers behind (data loaders, generation servers).
                for pid in child_pids() - children_before:
                    kill_process(pid, log)
                if reason := permanent_reason(exc):
                    log(f"{stage}: {reason}; not retried")
                if published:
                    shutil.rmtree(work_dir, ignore_errors=True)  # the checkpoints are of no use to a published stage
                else:
                    _record_failure(run_id, stage, exc, queue, tmp if tmp.exists() else work_dir, log_files, log)
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        ref = ref.model_copy(update={"digest": manifest["digest"], "parts": manifest["parts"]})
        shutil.rmtree(work_dir, ignore_errors=True)  # checkpoints are only a resume read_source
        log(f"{stage}: done in {seconds:.1f}s -> {final}")
        return StageOutcome(ref, cached=False, metrics=metrics, mlflow_run_id=run_id)


def resource_metrics(stage: str, resources: dict[str, float]) -> dict[str, float]:
    """The MLflow metrics of the manifest's `resources` (its one record of the build's time and memory):
    `<stage>/time/seconds` and `<stage>/memory/<name>`."""
    return {
        **({f"{stage}/time/seconds": resources["seconds"]} if "seconds" in resources else {}),
        **{f"{stage}/memory/{name}": value for name, value in resources.items() if name.endswith("_mb")},
    }


def outcome_tags(stage: str, training: dict | None, log: Callable[[str], None]) -> dict[str, str]:
    """MLflow tags (and a log line) for how a training stage ended: stopped early by a callback, the best checkpoint
    published."""
    tags: dict[str, str] = {}
    if training and training.get("stopped_early"):
        tags["rlhf.stopped_early"] = f"step {training['global_step']} of {training['max_steps']}"
        log(
            f"{stage}: stopped early by a callback at step {training['global_step']} of {training['max_steps']}; "
            "publishing what it has"
        )
    if training and training.get("best_checkpoint"):
        tags["rlhf.best_checkpoint"] = f"{training['best_checkpoint']} ({training['best_metric']:.6g})"
        log(
            f"{stage}: publishing the best checkpoint, {training['best_checkpoint']} (metric "
            f"{training['best_metric']:.6g}), not the last"
        )
    return tags


NOT_TOKENIZER_BOUND = ("data", "champion")
"""Upstreams whose models are compared by their text only (the champion may come from another base model)."""


def check_tokenizers(stage: str, upstream: dict[str, ArtifactRef]) -> dict[str, str]:
    """The tokenizer digest of every upstream model; they must be equal: a reward model reads the policy's token
    ids and KL compares two models' log-probabilities of the same ids. Raised before any weights load."""
    digests = {
        name: tokenizer_digest(ref.path / "model") for name, ref in upstream.items() if name not in NOT_TOKENIZER_BOUND
    }
    digests = {name: digest for name, digest in digests.items() if digest}
    if len(set(digests.values())) > 1:
        listed = "; ".join(f"{name} ({upstream[name].path / 'model'}): {digest}" for name, digest in digests.items())
        raise ValueError(
            f"{stage}: its input models do not share a tokenizer, so one model's token ids would be read with "
            f"another's vocabulary (tokenizer file digests: {listed}); train them from the same sft model, or pass "
            "models built from one base"
        )
    return digests


@contextmanager
def _key_lock(
    stage_root: Path, key: str, stage: str, log: Callable[[str], None], wait: float | None = None
) -> Iterator[None]:
    """An OS file lock per stage key (released by the OS if the holder dies, even by SIGKILL). The holder writes who
    it is beside the lock, so a wait longer than `wait` seconds fails naming it."""
    import socket

    from filelock import FileLock, Timeout

    locks = stage_root / ".locks"
    locks.mkdir(exist_ok=True)
    lock, holder = FileLock(locks / f"{key}.lock"), locks / f"{key}.holder.json"
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"{stage}: another run is building {key}; waiting for it")
        try:
            lock.acquire(timeout=-1 if wait is None else wait)
        except Timeout:
            try:
                held = json.loads(holder.read_text())
                run = held["flow_run"] or "none"
                who = f"pid {held['pid']} on {held['host']} (flow run {run}, since {held['since']})"
            except (OSError, ValueError, KeyError):
                who = "a process that left no record"
            raise TimeoutError(
                f"{stage}: waited {wait:.0f}s for the build of {key} held by {who}; retry.timeout_seconds bounds the "
                f"wait (stop that run, or remove {lock.lock_file} if no process holds it)"
            ) from None
    try:
        from rlhf_pipeline.tasks.orchestration.stage_task import current_flow_run

        holder.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "flow_run": current_flow_run()[0],
                    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            )
        )
        yield
    finally:
        lock.release()


REPLAY_SECONDS = 600.0
"""How long a finished stage waits for the tracking server to take the metrics it kept through an outage."""


def _record_in_mlflow(
    run_id: str,
    stage: str,
    final: Path,
    queue: MetricQueue,
    metrics: dict[str, float],
    step: int,
    log_files: tuple[str, ...],
    tags: dict[str, str],
    record_lineage: Callable[[], object],
) -> None:
    """A published stage's curve, files, final values and lineage (`tasks.tracking.lineage`) into its MLflow run, which
    ends FINISHED. A tracking server that does not answer fails the attempt transiently: the retry finds the artifact
    and records it as a cached run (its curve read from the artifact's history)."""
    try:
        if unsent := queue.close(REPLAY_SECONDS):
            raise ConnectionError(f"MLflow has not taken {unsent} rows of metrics in {REPLAY_SECONDS:.0f}s")
        if tags:
            tracking.set_tags(run_id, tags)
        for name in (MANIFEST, *log_files):
            _log_file(run_id, final, name)
        tracking.log_metrics(run_id, metrics, step)  # the final values sit at the end of the curves
        record_lineage()
        tracking.end_run(run_id)
    except Exception as exc:
        queue.abandon()
        raise ConnectionError(
            f"{stage}: published at {final}, but the MLflow run {run_id} could not be completed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the curve is in the artifact's "
            f"{HISTORY}, and the retry records the stage as cached"
        ) from exc


def _record_failure(
    run_id: str,
    stage: str,
    exc: BaseException,
    queue: MetricQueue,
    folder: Path,
    log_files: tuple[str, ...],
    log: Callable[[str], None],
) -> None:
    """The failed build's run: its curve so far, its reports, the error, FAILED. Never in the way of the error itself:
    with the tracking server down (the queue saw it), nothing waits on it, and a failure to record is only logged."""
    unsent = queue.close(0 if queue.down_since is not None else 30)
    queue.abandon()
    if unsent or queue.down_since is not None:
        log(f"{stage}: MLflow is not answering; the failure is not recorded in run {run_id} (its error follows here)")
        return
    try:
        for name in log_files:  # a failed validation still leaves its report in MLflow
            _log_file(run_id, folder, name)
        tracking.set_tags(run_id, {"rlhf.error": f"{type(exc).__name__}: {exc}"})
        tracking.end_run(run_id, failed=True)
    except Exception as failed:
        log(f"{stage}: could not record the failure in MLflow run {run_id} ({type(failed).__name__}: {failed})")


def _log_file(run_id: str, stage_dir: Path, name: str) -> None:
    """Log `stage_dir/name` (file or folder) at the same relative place in the MLflow run; nothing if the stage wrote
    none."""
    path = stage_dir / name
    if not path.exists():
        return
    target = name if path.is_dir() else (str(Path(name).parent) if "/" in name else None)
    tracking.log_artifacts(run_id, path, target)


def _synced(directory: Path) -> None:
    """Every file and folder under `directory` (and itself) flushed to the disk: a rename is durable only after the
    bytes it names are."""
    for path in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync(path)
    _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory into place, its bytes synced first and the rename after; never leave a
    half-written one at `final`."""
    _synced(tmp)
    try:
        _rename_into_place(tmp, final)
    finally:
        _fsync(final.parent)


def _rename_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        # A forced re-run, or leftovers without a manifest: move the old one aside first.
        trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
        return
    os.rename(tmp, final)
