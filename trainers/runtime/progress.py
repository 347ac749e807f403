"""A stage's progress as structured log records; whoever wants to draw it attaches a handler (docs/ARCHITECTURE.md,
"The trainer contract").

    rlhf_pipeline.trainers.runtime.progress         "sft: step 40/300 (13%) loss=1.2 ... eta 1m20s" at every metrics
                                                    log, with `record.progress`; it reaches the Prefect UI
                                                    (`rlhf_pipeline` is one of Prefect's extra loggers)
    rlhf_pipeline.trainers.runtime.progress.ticks   begin, every step, end: for a display only (no handler, no
                                                    propagation)

Every record carries `record.progress = {"stage", "event", "step", "total", "start", "values"}`. Nothing here draws:
`rlhf_pipeline.console` (the CLI's) turns the records into one bar per stage, so a change to the display re-keys no
stage. Ranks launched by accelerate forward them to the parent as `@@rlhf-progress` lines (`trainers.runtime.rank`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from rlhf_pipeline.trainers.runtime.heartbeat import beat

PROGRESS = logging.getLogger(__name__)
PROGRESS.setLevel(logging.INFO)
TICKS = logging.getLogger(f"{__name__}.ticks")
TICKS.setLevel(logging.INFO)
TICKS.propagate = False  # a tick per step is for a display, never for a log store


def emit(progress: dict[str, Any], message: str = "") -> None:
    """Log one progress record (`message` only for a "log" event, which is a line people read)."""
    beat()  # the stage moved: its watchdog (`heartbeat.watching`) waits no longer
    logger = PROGRESS if progress["event"] == "log" else TICKS
    logger.info(message or f"{progress['stage']}: {progress['event']} {progress['step']}", extra={"progress": progress})


class Progress:
    """Step counter with rate and ETA for one stage, on rank 0 only (`main`): `step` every step, `log` with the values
    of every metrics log, `close` at the end."""

    def __init__(self, stage: str, total: int, start_step: int = 0, main: bool = True):
        self.stage, self.total, self.start_step, self.started, self.main = (
            stage,
            total,
            start_step,
            time.monotonic(),
            main,
        )
        self.last = start_step
        self._emit("begin", start_step)

    def _emit(self, event: str, step: int, values: dict[str, float] | None = None, message: str = "") -> None:
        if self.main:
            record = {"stage": self.stage, "event": event, "step": step, "total": self.total, "start": self.start_step}
            emit({**record, "values": values or {}}, message)

    def step(self, step: int) -> None:
        if step > self.last:
            self.last = step
            self._emit("step", step)

    def log(self, step: int, values: dict[str, float]) -> None:
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        shown = " ".join(f"{k.rsplit('/', 1)[-1]}={v:.4g}" for k, v in list(values.items())[:4])
        line = (
            f"{self.stage}: step {step}/{self.total} ({step / max(self.total, 1):.0%}) {shown} "
            f"elapsed {duration(elapsed)} eta {duration(eta)}"
        )
        self.last = max(self.last, step)
        self._emit("log", step, values, line)

    def close(self) -> None:
        if self.main:
            self._emit("end", self.last)
            self.main = False  # once


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
