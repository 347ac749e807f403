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
import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Callable, ContextManager, Protocol

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
from rlhf_pipeline.tasks.store.leases import lease
from rlhf_pipeline.tasks.store.metric_queue import MetricQueue
from rlhf_pipeline.tasks.store.resources import PeakMemory, child_pids, frozen_heap, kill_process
from rlhf_pipeline.tasks.store.secrets import redact
from rlhf_pipeline.trainers.algorithms.loop import OUTCOME, PEAK_GPU, last_checkpoint
from rlhf_pipeline.trainers.models.load import tokenizer_digest
from rlhf_pipeline.trainers.runtime import heartbeat, stopping
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


class Recorder(Protocol):
    """What the store tells the tracking side about a stage, at four moments (tasks/tracking/recorder.py records it
    in MLflow; tests pass a fake). A published stage is safe whatever the recorder does: `published` runs after the
    rename, and its failure fails the attempt transiently (the retry records the stage as cached)."""

    def cached(self, entry: Entry, producer: str, curves: list, metrics: dict[str, float], log: Log) -> str:
        """A reused artifact: a run that says so, with the artifact's curve and final metrics. Returns its id."""
        ...

    def started(self, entry: Entry, log: Log) -> str:
        """A build begins (the key's lock held): runs of the key left RUNNING by a dead process end, a new one
        starts with the resolved config. Returns its id."""
        ...

    def sink(self, run_id: str) -> Callable[[list], None]:
        """Where the build's metric rows go, `(timestamp ms, values, step)` each (through a `MetricQueue`)."""
        ...

    def watching(self, run_id: str) -> ContextManager:
        """Held while a device stage builds: the machine's figures sampled into the run."""
        ...

    def describe(self, entry: Entry, folder: Path, metrics: dict[str, float]) -> None:
        """Before the listing, so the manifest vouches for it: the model card of a folder that holds a model."""
        ...

    def published(self, entry: Entry, run_id: str, queue: MetricQueue, finals: Finals) -> None:
        """The published stage's curve, files, final metrics and lineage; its run ends FINISHED."""
        ...

    def failed(self, entry: Entry, run_id: str, exc: BaseException, queue: MetricQueue, folder: Path, log: Log) -> None:
        """The failed build's curve so far, its reports and the error; its run ends FAILED. Never raises."""
        ...


Log = Callable[[str], None]


@dataclass(frozen=True)
class Entry:
    """A stage as the store keys it, and as a recorder is told of it."""

    ctx: RunContext
    stage: str
    key: str
    final: Path
    config: dict
    """The resolved config, secrets masked."""
    upstream: dict[str, ArtifactRef]
    tags: dict[str, str]
    log_files: tuple[str, ...] = ()
    """Paths inside the stage's folder logged with its run (reports, tables)."""


@dataclass(frozen=True)
class Finals:
    """What a published build ends with: its final metrics (resources included), the last step of its curve, and the
    tags that say how its training ended."""

    metrics: dict[str, float]
    step: int
    tags: dict[str, str]


def run_stage(
    stage: str,
    config: BaseModel | dict,
    upstream: dict[str, ArtifactRef],
    ctx: RunContext,
    build: Build,
    fingerprints: dict[str, str] | None = None,
    log_files: tuple[str, ...] = (),
    log: Log = print,
    digest_of: tuple[str, ...] = (),
    parts: dict[str, str] | None = None,
    code: ModuleType | None = None,
    hold: Callable[[], ContextManager] = contextlib.nullcontext,
    extra_tags: dict[str, str] | None = None,
    system_metrics: bool = False,
    *,
    record: Recorder,
    holder: dict[str, str] | None = None,
) -> StageOutcome:
    """Publish `<root>/<stage>/<key>/` by running `build`, or reuse it when its manifest exists.

    `record` is the tracking side (`Recorder`): told of a reuse, a build's start, curve, end or failure. `log_files`
    are paths inside the stage directory logged with the stage's run (reports, tables). `digest_of` names the paths
    dependents key on (default: every file), so a re-run that changes only a report (timestamps, a new rule)
    re-trains nothing. `parts` names paths whose digests are kept one by one (`ArtifactRef.select`). `code` is the
    module whose source (and imports) is the stage's code version; `hold()` is held while the build runs (the
    caller's device slot); `holder` says who holds the key's lock (e.g. the flow run), for whoever waits on it;
    `extra_tags` go on its run (e.g. `rlhf.round` of a feedback round); `system_metrics`: the machine is sampled
    while it builds (device stages).
    """
    check_tokenizers(stage, upstream)
    # Secrets are masked before anything is keyed, logged or written: a rotated token re-trains nothing.
    config_json = redact(config.model_dump(mode="json") if isinstance(config, BaseModel) else config)
    version = code_version(code.__name__ if code else None)
    key = stage_key(stage, config_json, upstream, fingerprints or {}, version)
    stage_root = Path(ctx.artifact_root) / stage
    final = stage_root / key
    tags = {"rlhf.stage": stage, "rlhf.key": key, "rlhf.artifact": str(final), **(extra_tags or {})}
    entry = Entry(ctx, stage, key, final, config_json, upstream, tags, log_files)

    stage_root.mkdir(parents=True, exist_ok=True)
    # One builder per key: a second run with the same inputs waits here, then finds the manifest.
    with _key_lock(stage_root, key, stage, log, ctx.wait_seconds, holder or {}):
        lease(stage_root, key, ctx.parent_run_id)  # `rlhf gc` leaves it alone until the run ends
        if (final / MANIFEST).is_file() and not ctx.force and (why := damage(final)):
            # Never reused, never blocking its key: kept aside for a look, and built again.
            aside = final.with_name(f".damaged-{key}-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
            log(f"{stage}: {final} cannot be reused: {why}; moved to {aside.name} and built again")
        if (final / MANIFEST).is_file() and not ctx.force:
            return _reuse(entry, record, log)
        keyed = {"fingerprints": fingerprints or {}, "code_version": version}
        return _build(entry, record, build, keyed, log, digest_of, parts, hold, system_metrics)


def _reuse(entry: Entry, record: Recorder, log: Log) -> StageOutcome:
    """The published artifact, as it is; its run records the reuse."""
    manifest = json.loads((entry.final / MANIFEST).read_text())
    ref = ArtifactRef(stage=entry.stage, key=entry.key, uri=str(entry.final))
    ref = ref.model_copy(update={"digest": manifest["digest"], "parts": manifest.get("parts", {})})
    metrics = {**manifest["metrics"], **resource_metrics(entry.stage, manifest.get("resources", {}))}
    run_id = record.cached(entry, manifest["mlflow_run_id"], read_history(entry.final), metrics, log)
    return StageOutcome(ref, "cached", metrics, mlflow_run_id=run_id)


def _build(
    entry: Entry,
    record: Recorder,
    build: Build,
    keyed: dict,
    log: Log,
    digest_of: tuple[str, ...],
    parts: dict[str, str] | None,
    hold: Callable[[], ContextManager],
    system_metrics: bool,
) -> StageOutcome:
    """Build into a temporary folder (resuming from the newest complete checkpoint), write its manifest, rename it
    into place, then record it. A failed build leaves no workers, no temporary folder and a FAILED run."""
    stage, stage_root = entry.stage, entry.final.parent
    work_dir = stage_root / ".work" / entry.key
    for leftover in stage_root.glob(f".tmp-{entry.key}-*"):  # half-built by a process that died
        shutil.rmtree(leftover, ignore_errors=True)
    if resume := last_checkpoint(work_dir):
        entry = dataclasses.replace(entry, tags={**entry.tags, "rlhf.resumed_from": Path(resume).name})
        log(f"{stage}: resuming from {resume}")
    run_id = record.started(entry, log)
    tmp = stage_root / f".tmp-{entry.key}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    started, last_step = time.time(), [0]
    work_dir.mkdir(parents=True, exist_ok=True)
    history = work_dir / HISTORY  # kept beside the checkpoints, so a resumed build keeps its early curve
    # Metrics go through a queue of their own: training never waits for the tracking server, and an outage loses
    # nothing (every row is in `history` first, and the queue sends the rest when the server answers again).
    queue = MetricQueue(record.sink(run_id), log, stage)

    def log_metrics(values: dict[str, float], step: int) -> None:
        last_step[0] = max(last_step[0], step)
        with open(history, "a") as f:
            f.write(json.dumps({"step": step, "metrics": values}) + "\n")
        queue.put(values, step)

    children_before = child_pids()
    published = False
    # A SIGTERM waits (its grace period) for the checkpoint and for the stop's record.
    with stopping.training():
        try:
            watching = record.watching(run_id) if system_metrics else contextlib.nullcontext()
            # A hang fails as `heartbeat.Stalled`, transient: the retry resumes from the last checkpoint.
            with (
                hold(),
                watching,
                heartbeat.watching(entry.ctx.stall_seconds, stage, log, work=f"{stage}/{entry.key}"),
                frozen_heap(),
                PeakMemory() as memory,
            ):
                metrics = build(tmp, work_dir, log_metrics)
            if history.is_file():
                shutil.copy(history, tmp / HISTORY)
            record.describe(entry, tmp, metrics)
            training = json.loads((tmp / OUTCOME).read_text()) if (tmp / OUTCOME).is_file() else None
            resources = {"seconds": round(time.time() - started, 3), "started": started, "finished": time.time()}
            resources |= memory.figures(training)
            manifest = _manifest(entry, tmp, keyed, training, metrics, run_id, resources, digest_of, parts)
            _publish(tmp, entry.final)  # the work is safe from here on, whatever the tracking server does
            published = True
            metrics = {**metrics, **resource_metrics(stage, resources)}
            record.published(entry, run_id, queue, Finals(metrics, last_step[0], outcome_tags(stage, training, log)))
        except BaseException as exc:
            # A timed-out or failed build leaves no workers behind (data loaders, generation servers).
            for pid in child_pids() - children_before:
                kill_process(pid, log)
            if reason := permanent_reason(exc):
                log(f"{stage}: {reason}; not retried")
            if published:
                shutil.rmtree(work_dir, ignore_errors=True)  # the checkpoints are of no use to a published stage
            else:
                record.failed(entry, run_id, exc, queue, tmp if tmp.exists() else work_dir, log)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    ref = ArtifactRef(
        stage=stage, key=entry.key, uri=str(entry.final), digest=manifest["digest"], parts=manifest["parts"]
    )
    shutil.rmtree(work_dir, ignore_errors=True)  # checkpoints are only a resume source
    log(f"{stage}: done in {resources['seconds']:.1f}s -> {entry.final}")
    return StageOutcome(ref, "built", metrics, mlflow_run_id=run_id)


def _manifest(
    entry: Entry,
    tmp: Path,
    keyed: dict,
    training: dict | None,
    metrics: dict[str, float],
    run_id: str,
    resources: dict[str, float],
    digest_of: tuple[str, ...],
    parts: dict[str, str] | None,
) -> dict:
    """The manifest of the build in `tmp`, written last: what it was built from, its files and their digests."""
    files = file_listing(tmp)
    manifest = {
        "stage": entry.stage,
        "key": entry.key,
        "config": entry.config,
        "upstream": {name: {"stage": r.stage, "key": r.key, "digest": r.digest} for name, r in entry.upstream.items()},
        "digest": content_digest(tmp, digest_of),
        "parts": {name: content_digest(tmp, (path,)) for name, path in (parts or {}).items() if (tmp / path).exists()},
        **keyed,
        "tokenizer": tokenizer_digest(tmp / "model"),
        "training": {name: value for name, value in training.items() if name != PEAK_GPU} if training else training,
        "versions": _versions(),
        "metrics": metrics,
        "mlflow_run_id": run_id,
        "resources": resources,
        FILES: files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


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
    stage_root: Path, key: str, stage: str, log: Log, wait: float | None, holder: dict[str, str]
) -> Iterator[None]:
    """An OS file lock per stage key (released by the OS if the holder dies, even by SIGKILL). The holder writes who
    it is beside the lock, so a wait longer than `wait` seconds fails naming it."""
    import socket

    from filelock import FileLock, Timeout

    locks = stage_root / ".locks"
    locks.mkdir(exist_ok=True)
    lock, record = FileLock(locks / f"{key}.lock"), locks / f"{key}.holder.json"
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"{stage}: another run is building {key}; waiting for it")
        try:
            lock.acquire(timeout=-1 if wait is None else wait)
        except Timeout:
            try:
                held = json.loads(record.read_text())
                run = held.get("flow_run") or "none"
                who = f"pid {held['pid']} on {held['host']} (flow run {run}, since {held['since']})"
            except (OSError, ValueError, KeyError):
                who = "a process that left no record"
            raise TimeoutError(
                f"{stage}: waited {wait:.0f}s for the build of {key} held by {who}; retry.timeout_seconds bounds the "
                f"wait (stop that run, or remove {lock.lock_file} if no process holds it)"
            ) from None
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        record.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), **holder, "since": since}))
        yield
    finally:
        lock.release()


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
