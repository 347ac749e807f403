"""A stage's progress as a Prefect progress artifact, `rlhf-<stage>-progress`, advancing while the stage builds.

The trainers already say how far they are: every TRL stage, ppo and the pairs sampling emit progress records
(`trainers.runtime.progress`: stage, step, total, start) at each step, and under `accelerate launch` rank 0's records
come to the parent as lines that `tasks.orchestration.launcher` logs again as records. `StageProgress` is a logging
handler on those records for the time a stage builds (`orchestration.device_hold` enters it): no module a trainer
imports changes, so no stage's code version (its import closure) moves because of a display.

The Prefect API is called from a thread of its own, never from the training thread: the newest reading is sent at most
once a second (older ones are dropped), an API that does not answer is logged once and tried again with a growing
pause, and the stage neither waits for it nor fails by it (its last value waits `CLOSE_WAIT` seconds at most).
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

INTERVAL = 1.0
"""Seconds between two calls to the Prefect API, at least."""
MAX_PAUSE = 30.0
"""The longest pause between two tries while the API does not answer."""
CLOSE_WAIT = 5.0
"""How long a finished build waits for its last value to reach the API."""


def artifact_key(stage: str) -> str:
    """`rlhf-<stage>-progress` (Prefect keys: lowercase letters, digits and dashes)."""
    return f"rlhf-{re.sub(r'[^a-z0-9]+', '-', stage.lower()).strip('-')}-progress"


@dataclass(frozen=True)
class Reading:
    """What the artifact shows: the percentage and its description."""

    percent: float
    description: str


def _create(percent: float, key: str, description: str) -> UUID:
    from prefect.artifacts import create_progress_artifact

    return create_progress_artifact(percent, key=key, description=description)


def _update(artifact_id: UUID, percent: float, description: str) -> None:
    from prefect.artifacts import update_progress_artifact

    update_progress_artifact(artifact_id, percent, description=description)


class StageProgress(logging.Handler):
    """The progress artifact of one build of `stage`, fed by the progress records of that stage (rank 0's included).

    `with StageProgress("sft", log):` around the build; the artifact is created at the first record (a build that emits
    none, such as eval's, makes no artifact) and updated from the newest one. `create(percent, key, description) -> id`
    and `update(id, percent, description)` are Prefect's `create_progress_artifact` and `update_progress_artifact`.
    """

    def __init__(
        self,
        stage: str,
        log: Callable[[str], None] = print,
        interval: float = INTERVAL,
        create: Callable[[float, str, str], Any] = _create,
        update: Callable[[Any, float, str], None] = _update,
        close_wait: float = CLOSE_WAIT,
    ) -> None:
        super().__init__(level=logging.INFO)
        self.stage, self.key, self._log, self._interval = stage, artifact_key(stage), log, interval
        self._create, self._update, self._close_wait = create, update, close_wait
        self._changed = threading.Condition()
        self._step = self._total = self._trainings = 0
        self._ending = ""  # set when the build is over: what the last description adds
        self._closed = False
        self._sent: Reading | None = None
        self._thread: threading.Thread | None = None
        self._context: contextvars.Context | None = None
        self.artifact_id: Any = None
        self.calls = 0
        """Calls made to the API (tried, answered or not)."""
        self.down_since: float | None = None
        """When the API stopped answering (None: it answers)."""

    # -- the training side: cheap, never blocks on the API --------------------------------------------------------

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if not isinstance(progress, dict) or progress.get("stage") != self.stage:
            return
        with self._changed:
            if progress["event"] == "begin":
                self._trainings += 1  # a stage that trains more than once (an ensemble's members) starts again at 0
            self._total = int(progress["total"] or 0)
            self._step = int(progress["step"]) if progress["event"] == "begin" else max(self._step, progress["step"])
            if self._thread is None and self._context is not None and not self._closed:
                self._thread = threading.Thread(
                    target=self._context.run, args=(self._run,), name=f"progress-artifact-{self.stage}", daemon=True
                )
                self._thread.start()
            self._changed.notify_all()

    def reading(self) -> Reading:
        """The newest reading: the share of the planned steps done, and the steps in words."""
        with self._changed:
            total, step = self._total, min(self._step, self._total) if self._total else self._step
            percent = round(100.0 * step / total, 1) if total > 0 else 0.0
            which = f" (training {self._trainings})" if self._trainings > 1 else ""
            return Reading(percent, f"`{self.stage}`{which}: step {step} of {total}{self._ending}")

    def __enter__(self) -> StageProgress:
        # The thread runs in the build's context: the artifact belongs to its task run and flow run.
        self._context = contextvars.copy_context()
        from rlhf_pipeline.trainers.runtime.progress import PROGRESS, TICKS

        for logger in (PROGRESS, TICKS):
            logger.addHandler(self)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        from rlhf_pipeline.trainers.runtime.progress import PROGRESS, TICKS

        for logger in (PROGRESS, TICKS):
            logger.removeHandler(self)
        with self._changed:
            if kind is not None and not self._ending:
                self._ending = f"; stopped ({kind.__name__})"
            elif kind is None and self._total and self._step >= self._total:
                self._ending = " (done)"
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(self._close_wait)  # a hanging API keeps its daemon thread, not the stage

    # -- the API side: a thread of its own -----------------------------------------------------------------------

    def _next(self) -> Reading | None:
        """Wait for a reading other than the one sent; None when the build is over and all is sent."""
        with self._changed:
            while True:
                reading = self.reading()
                if reading != self._sent:
                    return reading
                if self._closed:
                    return None
                self._changed.wait()

    def _run(self) -> None:
        pause, last = self._interval, float("-inf")
        while self._next() is not None:
            with self._changed:  # at most one call a `pause`; the end of the build does not wait for it
                self._changed.wait_for(lambda: self._closed, timeout=max(0.0, last + pause - time.monotonic()))
            reading, last = self.reading(), time.monotonic()
            self.calls += 1
            try:
                if self.artifact_id is None:
                    self.artifact_id = self._create(reading.percent, self.key, reading.description)
                else:
                    self._update(self.artifact_id, reading.percent, reading.description)
            except Exception as exc:  # any failure of the API: the stage goes on, the next reading tries again
                if self.down_since is None:
                    self.down_since = time.time()
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    self._log(
                        f"{self.stage}: the Prefect API did not take the progress artifact {self.key} "
                        f"({type(exc).__name__}: {first}); training goes on, and it is tried again"
                    )
                pause = min(pause * 2, MAX_PAUSE)
                if self._closed:
                    return  # the build is over: its last value is not worth a wait
                continue
            self._sent = reading
            if self.down_since is not None:
                self._log(
                    f"{self.stage}: the Prefect API answers again after {time.time() - self.down_since:.0f}s; "
                    f"{self.key} shows {reading.percent:g}%"
                )
                self.down_since, pause = None, self._interval


def stage_progress(stage: str, log: Callable[[str], None] = print):
    """The progress artifact of a build of `stage` inside a Prefect task run; outside one, nothing."""
    import contextlib

    from prefect.context import TaskRunContext

    return StageProgress(stage, log) if TaskRunContext.get() is not None else contextlib.nullcontext()
