"""The terminal of `rlhf run` and `rlhf eval`: one bar per training stage, drawn from the trainers' progress records
(`trainers.runtime.progress`), as TRL's caller adds `RichProgressCallback`. Only the CLI imports this module, so nothing
here is in a stage's code version: a change to the display re-keys no stage (docs/ARCHITECTURE.md, "Layers").
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from rlhf_pipeline.trainers.runtime.progress import PROGRESS, TICKS

KEY_METRICS = ("loss", "reward", "accuracy", "kl", "exact_match", "margin")
"""What a stage's bar shows: the first three of these it logs."""
TERMINAL_REFRESH_SECONDS = 0.1
PIPE_REFRESH_SECONDS = 30.0
"""Not a terminal (a pipe, a log file): tqdm writes each refresh as a line of its own, so it refreshes every 30 s
there."""


class ConsoleBars(logging.Handler):
    """Draws one tqdm bar per stage from progress records (step, rate, ETA, key metrics), even where TQDM_DISABLE turns
    the libraries' bars off."""

    def __init__(self, stream=None):
        super().__init__()
        self.stream = stream or sys.stderr
        self.bars: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if progress is None:
            return
        stage, event, step = progress["stage"], progress["event"], progress["step"]
        bar = self.bars.get(stage)
        if event == "begin" or bar is None:
            if bar is not None:
                bar.close()
            bar = self.bars[stage] = self._bar(stage, progress["total"], progress["start"])
        if event == "log":
            shown = [
                (k.rsplit("/", 1)[-1], v) for k, v in progress["values"].items() if k.rsplit("/", 1)[-1] in KEY_METRICS
            ]
            bar.set_postfix_str(" ".join(f"{name}={value:.4g}" for name, value in shown[:3]), refresh=False)
        if step > bar.n:
            bar.update(step - bar.n)
        if event == "end":
            bar.close()
            del self.bars[stage]

    def _bar(self, stage: str, total: int, start: int):
        from tqdm.auto import tqdm

        _keep_progress_lines_off_prefects_console()

        every = TERMINAL_REFRESH_SECONDS if self.stream.isatty() else PIPE_REFRESH_SECONDS
        return tqdm(
            total=total,
            initial=start,
            desc=stage,
            unit="step",
            file=self.stream,
            disable=False,
            dynamic_ncols=True,
            mininterval=every,
        )


class _NotProgress(logging.Filter):
    """Keeps the progress lines off Prefect's console handler (the bar shows them); they still reach the Prefect UI."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != PROGRESS.name


def install() -> ConsoleBars:
    """Draw the bars on this process's terminal, and keep the library noise a bar replaces off it."""
    handler = ConsoleBars()
    for logger in (PROGRESS, TICKS):
        if not any(isinstance(h, ConsoleBars) for h in logger.handlers):
            logger.addHandler(handler)
    # TRL 1.16's disable_gradient_checkpointing (trl/models/utils.py) reads transformers 5.24's deprecated property on
    # every checkpoint and generation: a FutureWarning we cannot fix at its cause.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    return handler


def _keep_progress_lines_off_prefects_console() -> None:
    """Prefect adds its console handler when a flow starts, so this runs when a stage's bar starts: the bar shows what
    the progress lines say (our handler sees each record before the ones above it)."""
    for handler in logging.getLogger("rlhf_pipeline").handlers + logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and not any(
            isinstance(f, _NotProgress) for f in handler.filters
        ):
            handler.addFilter(_NotProgress())
