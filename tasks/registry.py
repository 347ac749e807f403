"""`registry`: register the policy as a model version; move `champion` only when it wins.

Every run's policy becomes (or reuses, by content digest) a version of the registered model and takes the alias
`candidate`. The alias `champion` moves to it only when the gate passes on the eval stage's metrics and the champion
is still the one eval compared against (compare and set, under a lock on the tracking server: one promotion at a time
for every run that uses it). Even a first version becomes champion only when it beats its own start on the held-out
gold metric (`registry.beat_start`; without a gold metric or reference answers nothing measures that, and it stays a
candidate) and does not game its reward. `models:/<name>@champion` then loads with `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from rlhf_pipeline.tasks.gate import CANDIDATE, CHAMPION, RegistryConfig, below_start, gate, hacking, unmeasured
from rlhf_pipeline.tasks.orchestration.stage_task import current_flow_run, prefect_log
from rlhf_pipeline.tasks.store.artifacts import FILES, ArtifactRef, RunContext
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking import lineage, versions
from rlhf_pipeline.tasks.tracking.cards import EVAL_METRICS_TAG


def current_champion(cfg: RegistryConfig) -> ArtifactRef | None:
    """The champion's files, downloaded into the state folder (eval compares against them)."""
    if not cfg.enabled:
        return None
    version = versions.alias_version(cfg.model_name, CHAMPION)
    if version is None:
        return None
    folder = tracking.state_dir() / "registry" / cfg.model_name / f"v{version}"
    versions.download_version(cfg.model_name, version, folder / "model")
    digest = versions.version_tags(cfg.model_name, version).get("rlhf.policy_digest", "")
    return ArtifactRef(stage="champion", key=f"{cfg.model_name}/v{version}", uri=str(folder), digest=digest)


def compared_champion(report: ArtifactRef) -> str | None:
    """The champion version eval compared the policy with (its `champion` upstream), or None if there was none."""
    key = report.manifest().get("upstream", {}).get("champion", {}).get("key", "")
    return key.rpartition("/v")[2] or None


LOCK_SUFFIX = ".promoting"
STALE_LOCK_SECONDS = 600.0  # a promotion takes seconds; a lock held this long was left by a process that died


def _holder_gone(holder: str | None) -> bool:
    """Whether the lock's holder is a process of this machine that no longer runs (one elsewhere cannot be seen)."""
    import socket

    import psutil

    try:
        record = json.loads(holder or "")
        return record["host"] == socket.gethostname() and not psutil.pid_exists(int(record["pid"]))
    except (ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def champion_lock(model_name: str, wait_seconds: float = 900.0) -> Iterator[None]:
    """One promotion at a time per registered model on the tracking server itself, whichever machine or state folder
    the runs use: the lock is a registered model `<name>.promoting`, which exists while its holder compares and moves
    `champion` (creating a registered model that exists fails on every MLflow store: a test-and-set). A lock is taken
    over when its holder is a process of this machine that died, or when this waiter has itself watched the same lock
    (its creation time and holder) for `STALE_LOCK_SECONDS` on its own monotonic clock: no two machines' clocks are
    compared, so one whose clock runs ahead cannot take over a live lock."""
    import os
    import random
    import socket
    import time

    from mlflow.exceptions import MlflowException

    mlflow, lock = tracking.client(), f"{model_name}{LOCK_SUFFIX}"
    holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "state": str(tracking.state_dir())})
    deadline = time.monotonic() + wait_seconds
    first_seen: dict[tuple, float] = {}  # a lock instance (creation time, holder) -> when this waiter first saw it
    while True:
        try:
            mlflow.create_registered_model(lock, tags={"rlhf.holder": holder}, description="rlhf: a promotion runs")
            break
        except MlflowException as exc:
            # A store that finds the name taken reads the holder's model back; when the holder released it in between,
            # that read answers RESOURCE_DOES_NOT_EXIST: the lock is free again.
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                continue
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        try:
            held = mlflow.get_registered_model(lock)
        except MlflowException:
            continue  # released meanwhile
        who = held.tags.get("rlhf.holder")
        watched = time.monotonic() - first_seen.setdefault((held.creation_timestamp, who), time.monotonic())
        if _holder_gone(who) or watched > STALE_LOCK_SECONDS:
            why = "it died" if _holder_gone(who) else f"held for over {STALE_LOCK_SECONDS:.0f}s while this run waited"
            prefect_log(f"registry: taking over {lock!r}, left by {who} ({why})")
            with contextlib.suppress(MlflowException):
                mlflow.delete_registered_model(lock)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"registry: {lock!r} was held for over {wait_seconds:.0f}s by {who}; if no such process runs, delete "
                "that registered model"
            )
        time.sleep(0.2 + random.random() * 0.3)
    try:
        yield
    finally:
        mlflow.delete_registered_model(lock)


def register_policy(
    cfg: RegistryConfig, policy: ArtifactRef, report: ArtifactRef, stages: list[ArtifactRef], ctx: RunContext
) -> dict:
    """Register (or reuse) the policy's version, set `candidate`, and promote it if the gate passes."""
    metrics = report.manifest()["metrics"]
    version = _version_of(cfg, policy, stages, metrics, ctx)
    versions.set_alias(cfg.model_name, CANDIDATE, version)

    promoted, reason, champion = _decide(cfg, report, metrics, version)
    versions.set_version_tags(cfg.model_name, version, _verdict_tags(cfg, metrics, promoted, reason))
    outcome = {
        "model_name": cfg.model_name,
        "version": version,
        "promoted": promoted,
        "reason": reason,
        "previous_champion": champion,
    }

    run_id = tracking.start_run(ctx.experiment_id, "registry", {"rlhf.stage": "registry"}, ctx.parent_run_id)
    tracking.log_params(run_id, cfg.model_dump(mode="json"))
    tracking.set_tags(run_id, {f"rlhf.registry.{k}": str(v) for k, v in outcome.items()})
    tracking.log_metrics(run_id, {"registry/gate/promoted": float(promoted)})
    tracking.end_run(run_id)
    prefect_log(
        f"registry: {cfg.model_name} v{version} is candidate; champion "
        f"{'moved' if promoted and champion != version else 'stays'} ({reason})"
    )
    from rlhf_pipeline.tasks.orchestration.events import (
        announce,  # rlhf.model.candidate / rlhf.model.promoted for automations
    )

    announce(outcome, cfg.gate_metric, metrics, ctx.parent_run_id)
    return outcome


def _version_of(
    cfg: RegistryConfig, policy: ArtifactRef, stages: list[ArtifactRef], metrics: dict, ctx: RunContext
) -> str:
    """The policy's model version: the one registered for its digest before, else a new one, from its logged model
    (its stage logged it; a policy from elsewhere is logged here, on the parent run), tagged with what it was built
    from."""
    version = versions.find_version(cfg.model_name, "rlhf.policy_digest", policy.digest)
    if version is not None:
        return version
    # The policy's logged model (its stage logged it; a policy from elsewhere is logged here, on the parent run),
    # and the logged models it was built from: what `tasks.tracking.resolve` reads on a machine with only the
    # tracking server.
    models = lineage.upstream_models({ref.stage: ref for ref in stages})
    model_id = (
        models.get(policy.stage)
        or tracking.log_model(
            ctx.parent_run_id,
            ctx.experiment_id,
            policy.stage,
            policy.path / "model",
            policy.digest,
            {},
            {"rlhf.stage": policy.stage},
            lineage.model_type(policy.path / "model"),
            lineage.card_text(policy.path / "model"),
        )[0]
    )
    fingerprints = stages[0].manifest().get("fingerprints", {}) if stages else {}
    built_from = {
        "keys": {ref.stage: ref.key for ref in stages},
        "models": models,
        "data": fingerprints,
        "flow_run_id": current_flow_run()[0],
        "mlflow_run_id": ctx.parent_run_id,
    }
    # What a person reads on the version page, and what the code reads back: the algorithm, the bytes and their copy
    # check, the eval metrics (one JSON tag: the eval run has them all), the lineage in one tag.
    tags = {
        "rlhf.policy_stage": policy.stage,
        "rlhf.policy_digest": policy.digest,
        versions.FILES_TAG: _files_tag(policy),
        EVAL_METRICS_TAG: _metrics_tag(metrics),
        lineage.LINEAGE_TAG: json.dumps(built_from, sort_keys=True),
    }
    return versions.register_version(
        cfg.model_name, model_id, ctx.parent_run_id, tags, lineage.card_text(policy.path / "model")
    )


def _metrics_tag(metrics: dict) -> str:
    """The eval metrics as JSON, 6 significant digits, as many as fit a tag (5,000 characters), in name order."""
    kept: dict[str, float] = {}
    for name in sorted(metrics):
        value = float(f"{metrics[name]:.6g}")
        if len(json.dumps({**kept, name: value})) > 5000:
            break
        kept[name] = value
    return json.dumps(kept, sort_keys=True)


def _verdict_tags(cfg: RegistryConfig, metrics: dict, promoted: bool, reason: str) -> dict[str, str]:
    """The gate's verdict on the version page: promoted or not, why, and the metric it compared."""
    metric = cfg.resolved(set(metrics)).gate_metric or ""
    value = metrics.get(metric)
    return {
        "rlhf.gate": "promoted" if promoted else "candidate",
        "rlhf.gate.reason": reason,
        **({metric: f"{value:.6g}"} if value is not None else {}),
    }


def _decide(cfg: RegistryConfig, report: ArtifactRef, metrics: dict, version: str) -> tuple[bool, str, str | None]:
    """Whether `version` becomes champion, why, and the champion before: compare and set under the model's lock, so
    no other run moves `champion` in between."""
    seen = compared_champion(report)
    with champion_lock(cfg.model_name):  # compare and set: no other run moves `champion` in between
        champion = versions.alias_version(cfg.model_name, CHAMPION)
        if hacked := hacking(cfg, metrics):  # even a first version: a policy that games its reward is no champion
            promoted, reason = False, hacked
        elif weaker := below_start(cfg, metrics):  # even a first version: no worse than where it started
            promoted, reason = False, weaker
        elif champion == version:
            promoted, reason = True, "already champion"
        elif champion != seen:
            promoted, reason = (
                False,
                (
                    f"the champion moved to v{champion} after eval compared this policy with "
                    f"{f'v{seen}' if seen else 'no champion'}: it stays a candidate (a new run evaluates it against "
                    f"v{champion})"
                    if champion
                    else f"the champion v{seen} that eval compared against is gone: it stays a candidate"
                ),
            )
        elif champion is None and (unknown := unmeasured(cfg, metrics)):
            promoted, reason = False, unknown
        elif champion is None:
            promoted, reason = True, "no champion yet: the first version becomes champion"
        else:
            promoted, reason = gate(cfg, metrics)
        if promoted:
            versions.set_alias(cfg.model_name, CHAMPION, version)
    return promoted, reason, champion


def _files_tag(policy: ArtifactRef) -> str:
    """The policy's model files with their digests, from its manifest (read, not hashed again): each later copy of
    the version is checked against them. Empty where they do not fit a tag (MLflow keeps 5,000 characters)."""
    listing = policy.manifest().get(FILES) or {}
    files = {
        path.removeprefix("model/"): entry["sha256"][:16]
        for path, entry in listing.items()
        if path.startswith("model/")
    }
    text = json.dumps(files, sort_keys=True) if files else ""
    return text if len(text) <= 5000 else ""


def register_task():
    """`register_policy` as the flow's `registry` task (transient errors retried, never cached: the gate reads the live
    registry)."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from rlhf_pipeline.tasks.orchestration.stage_task import is_transient

    return task(
        name="registry",
        task_run_name="registry",
        retry_condition_fn=is_transient,
        cache_policy=NO_CACHE,
        persist_result=False,
        log_prints=False,
    )(register_policy)
