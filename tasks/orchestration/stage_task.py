"""The Prefect side of a stage: the task decorator, retries, device slots, run logs and MLflow links.

`tasks.store.stage` holds the contract (key, publish, cache); this module makes a
stage a Prefect task that retries transient failures, holds a GPU slot while
it builds and shows up in the Prefect UI with a link to its MLflow run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, ContextManager

from rlhf_pipeline.tasks.config import RetryConfig
from rlhf_pipeline.tasks.orchestration.progress_artifact import stage_progress
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, StageOutcome
from rlhf_pipeline.tasks.store.secrets import redact_text
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.trainers.runtime.failures import PERMANENT, permanent_reason
from rlhf_pipeline.trainers.runtime.stopping import TERMINATING


def retrying(config: RetryConfig) -> Callable:
    """`retrying(params.retry)(train_sft).submit(...)`: the task with the run's retry policy and time limit."""
    return lambda task: task.with_options(**config.task_options())


def stage_runner():
    """The flows' task runner: Prefect's thread pool with one worker, so that every stage of a run builds on the same
    thread. The steps run one after another anyway (each waits for the one before it), but with the default runner
    each would run on a thread of its own, and the threads of the stages before stay alive, each with the OpenMP pool
    its torch work started. Once the pools' threads outnumber the cores, libgomp cuts its spin-waits short and every
    parallel region puts its workers to sleep and wakes them through the kernel: eval's generation on SmolLM2 took 26%
    longer beside an earlier stage's pool than after it on the same thread (`bench.threads`, docs/PERFORMANCE.md).

    A task's run is created when the worker starts it, right after the step before it ended; Prefect makes a task whose
    parameter is a future of a task it reads as running its child (a nested node in the UI's graph), and it reads that
    state from the server, which records a finished task's state a moment later. So each future keeps its final state
    the moment its task ends, before the worker starts the next."""
    from prefect.task_runners import ThreadPoolTaskRunner

    class OneThread(ThreadPoolTaskRunner):  # Prefect copies it per flow run with the same `max_workers`
        def submit(self, task, parameters, wait_for=None, dependencies=None):  # type: ignore[override]
            future = super().submit(task, parameters, wait_for, dependencies)
            future.add_done_callback(lambda done: done.wait())  # `wait` keeps the final state on the future
            return future

    return OneThread(max_workers=1)


DEVICE_LIMIT_ENV = "RLHF_DEVICE_LIMIT"


def device_limit() -> str:
    """Name of the Prefect global concurrency limit that device stages hold a slot of while they build."""
    return os.environ.get(DEVICE_LIMIT_ENV, "rlhf-gpu")


def coordinated() -> bool:
    """Runs share device slots only through a Prefect server (`PREFECT_API_URL`). A temporary
    server lives as long as one `rlhf run` and keeps its leases in memory: a slot held by a
    run that was killed would never come back."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return bool(url) and url != os.environ.get(TEMPORARY_SERVER_ENV)  # `rlhf run` names the temporary server it started


TEMPORARY_SERVER_ENV = "RLHF_TEMPORARY_PREFECT_API_URL"
"""Set by `rlhf run`/`rlhf eval` to the API URL of the temporary server they started (rlhf_pipeline.cli): not a server
to coordinate through."""


def ensure_device_limit(slots: int = 1) -> None:
    """Create the device limit with `slots` slots if it does not exist (an existing one is left as its owner set it)."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(device_limit())
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=device_limit(), limit=slots))


@contextmanager
def device_slot(stage: str, log: Callable[[str], None] = print, wait_seconds: float | None = None) -> Iterator[None]:
    """Hold one slot of the device limit while a training or generating stage builds.

    Two flow runs then never train on the same GPU at once: the second waits
    here (its cached stages do not), at most `wait_seconds` (None: without end), and then fails naming who holds
    the slot. Outside a Prefect run, or without a Prefect server, it is a no-op. The slot is leased for a minute at a
    time and renewed while the stage runs, so a run that is killed frees it within a minute. A Prefect server that
    does not answer for longer loses the lease: Prefect says so in the stage's log ("Concurrency lease renewal
    failed"), and the stage trains on (docs/ARCHITECTURE.md, Prefect).
    """
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    if context is None or not coordinated():
        yield
        return
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency

    waited, acquired = time.time(), False
    try:
        with concurrency(
            device_limit(),
            occupy=1,
            lease_duration=60,
            timeout_seconds=wait_seconds,
            holder=ConcurrencyLeaseHolder(type="task_run", id=context.task_run.id),
            raise_on_lease_renewal_failure=False,  # the work in progress is worth more than the slot
        ):
            acquired = True
            if time.time() - waited > 1:
                log(f"{stage}: waited {time.time() - waited:.0f}s for a slot of concurrency limit {device_limit()!r}")
            yield
    except TimeoutError as exc:
        if acquired:  # the stage's own, not the wait's
            raise
        raise TimeoutError(
            f"{stage}: no slot of concurrency limit {device_limit()!r} within {wait_seconds:.0f}s "
            f"(retry.timeout_seconds); held by {slot_holders(context.task_run.id)}"
        ) from exc


def slot_holders(own: Any) -> str:
    """Who holds the device slots, in words: the device stages running now in other task runs, with their flow
    runs (Prefect has no API that lists a limit's lease holders)."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterState, TaskRunFilterStateType
    from prefect.client.schemas.objects import StateType

    from rlhf_pipeline.tasks.stages import BY_NAME

    device = {name for name, row in BY_NAME.items() if row.device}
    running = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING])))
    try:
        with get_client(sync_client=True) as client:
            holders = []
            for run in client.read_task_runs(task_run_filter=running, limit=50):
                if run.id == own or run.name.rsplit("-", 1)[0] not in device:
                    continue
                flow_run = client.read_flow_run(run.flow_run_id) if run.flow_run_id else None
                since = run.start_time.strftime("%H:%M:%S UTC") if run.start_time else "?"
                where = f"flow run {flow_run.name!r}" if flow_run is not None else "no flow run"
                holders.append(f"{run.name} of {where}, running since {since}")
    except Exception as exc:  # naming the holder must not hide the timeout
        return f"(the holders could not be read: {type(exc).__name__})"
    return "; ".join(holders) or "no device stage running now (a killed run's lease frees within a minute)"


def device_hold(
    stage: str, device: bool, log: Callable[[str], None] = print, wait_seconds: float | None = None
) -> Callable[[], ContextManager[None]]:
    """What `tasks.store.stage.run_stage` holds while the stage builds: a device slot where the table says it uses the
    device, waited for at most `wait_seconds`, and the stage's progress artifact
    (`tasks.orchestration.progress_artifact`: in a task run, `rlhf-<stage>-progress` advances with the trainer's
    progress records, rank 0's included)."""

    @contextmanager
    def hold() -> Iterator[None]:
        slot = device_slot(stage, log, wait_seconds) if device else contextlib.nullcontext()
        with stage_progress(stage, log), slot:
            yield

    return hold


# MLflow answers these for a run, model or experiment that is not in the store: asking again cannot help.
PERMANENT_MLFLOW_CODES = frozenset({"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS"})


def is_transient(task, task_run, state) -> bool:
    """Retry I/O and infrastructure failures; bad config or data (ValueError...) and MLflow's
    "does not exist" fail at once."""
    if TERMINATING.is_set():  # SIGTERM: the process is going away; the next attempt resumes from the checkpoint
        return False
    exc = state.result(raise_on_failure=False)
    return not is_permanent(exc)


def is_permanent(exc: BaseException) -> bool:
    """Bad config or data, MLflow's "does not exist", and what `trainers.runtime.failures` names (out of memory, corrupt
    weights, refused credentials, a missing or gated repository, no permission, a full disk)."""
    return (
        isinstance(exc, PERMANENT)
        or getattr(exc, "error_code", None) in PERMANENT_MLFLOW_CODES
        or permanent_reason(exc) is not None
    )


SHOWN = {
    "awaiting": ("AwaitingLabels", "samples published, labels awaited"),
    "skipped": ("Skipped", "switched off"),
    "cached": ("Cached", "manifest found"),
}
"""The Prefect state a stage's task ends in (name, message) when it built nothing now."""


def stage_task(stage: str):
    """Make `fn(...) -> StageOutcome` a Prefect task named after the stage, with the default RetryConfig
    (a flow applies the run's own with `retrying(params.retry)`).

    A manifest hit finishes in a `Cached` state (type COMPLETED), so the Prefect
    UI and API show which stages did not run; the task's result is the ArtifactRef.
    """
    import functools

    from prefect import task
    from prefect.cache_policies import NO_CACHE
    from prefect.states import Completed

    def decorate(fn: Callable[..., StageOutcome]):
        @functools.wraps(fn)
        def run(*args, **kwargs) -> ArtifactRef:
            outcome = fn(*args, **kwargs)
            _link_mlflow_run(stage, outcome.mlflow_run_id)
            if outcome.state == "built":
                return outcome.ref
            name, why = SHOWN[outcome.state]
            return Completed(data=outcome.ref, name=name, message=f"{why}: {outcome.ref.uri}")

        return task(
            name=stage,
            task_run_name=stage,
            **RetryConfig().task_options(),
            retry_condition_fn=is_transient,
            # Weights never pass through Prefect's result storage: tasks return refs,
            # and the artifact store decides about caching (see module docstring).
            cache_policy=NO_CACHE,
            persist_result=False,
            # Prints stay prints. A served run otherwise patches `print` into the task log, which swallows
            # what libraries capture from stdout: `datasets` hashes TRL's map functions with dill, whose
            # `nestedglobals` reads `dis` output from a captured stdout; patched, ~1,000 lines of bytecode
            # per stage flooded the Prefect logs and dill saw no globals. Our own lines go through loggers.
            log_prints=False,
        )(run)

    return decorate


def _link_mlflow_run(stage: str, run_id: str) -> None:
    """A link artifact on the task run to its MLflow run, when the MLflow UI has an address."""
    link = tracking.run_url(run_id) if run_id else None
    if link:
        from prefect.artifacts import create_link_artifact

        create_link_artifact(link, link_text=f"{stage} in MLflow", description=f"MLflow run of the `{stage}` stage")


def current_flow_run() -> tuple[str, str]:
    """The id and name of the flow run this code runs in ("", "rlhf" outside one)."""
    from prefect.runtime import flow_run

    return flow_run.get_id() or "", flow_run.get_name() or "rlhf"


def lock_holder() -> dict[str, str]:
    """Who builds a stage, as the store writes it beside the key's lock for whoever waits: the flow run."""
    return {"flow_run": current_flow_run()[0] or ""}


def prefect_log(message: str) -> None:
    """Into the flow run's log (the Prefect UI) when there is one, else the `rlhf` logger."""
    import logging

    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    message = redact_text(message)
    try:
        get_run_logger().info(message)
    except MissingContextError:
        logging.getLogger("rlhf").info(message)
