"""Ctrl-C during `rlhf run` and `rlhf eval` stops the run as SIGTERM does (`trainers.runtime.stopping`): every stage
that is training writes a checkpoint at the end of its step and stops, then the flow run ends Cancelled in Prefect and
MLflow, the temporary Prefect server stops last, one line says how to resume, and the process exits with 130 (the
shell's code for Ctrl-C). A second Ctrl-C exits at once.

The terminal sends Ctrl-C to every process of the foreground group: the temporary server runs in a group of its own
(`deployments.temporary`) and launched ranks ignore it (`tasks.orchestration.launcher`); the ranks get SIGTERM
from their stage, as under a cancel.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO

EXIT_CODE = 130
"""128 + SIGINT, what a shell reports for a program that Ctrl-C ended."""


@contextlib.contextmanager
def stop_on_ctrl_c(stop_server: Callable[[], None]) -> Iterator[None]:
    """While inside (the main thread), Ctrl-C stops the run; `stop_server` stops the temporary Prefect server, if any.
    Leaving the block after a Ctrl-C waits for the stop, which ends the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping: list[threading.Thread] = []
    settled = threading.Event()  # the flow has returned or raised: nothing more of it reaches Prefect or MLflow

    def handler(signum, frame) -> None:
        if stopping:  # the second Ctrl-C: no more waiting
            os.write(2, b"\nrlhf: stopped at once (a second Ctrl-C); checkpoints written so far are kept\n")
            stop_server()
            os._exit(EXIT_CODE)
        from rlhf_pipeline.tasks.orchestration.parent_run import open_runs
        from rlhf_pipeline.trainers.runtime.stopping import TERMINATING, grace_seconds

        TERMINATING.set()
        runs = open_runs()
        terminal = _quiet_terminal()
        print(
            f"\nrlhf: Ctrl-C: stopping; a stage that is training saves a checkpoint at the end of its step (up to "
            f"{grace_seconds():.0f}s; Ctrl-C again quits at once)",
            file=terminal,
            flush=True,
        )
        args = (runs, settled, stop_server, terminal)
        thread = threading.Thread(target=_stop, args=args, name="ctrl-c", daemon=True)
        stopping.append(thread)
        thread.start()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        settled.set()
        if stopping:  # the flow ended (its stages raised, or it finished) while the run stops: the stop ends it
            stopping[0].join()
        signal.signal(signal.SIGINT, previous)


SETTLE_SECONDS = 5.0
"""How long the stop waits, after the checkpoints, for the flow to record its own end (its failed stage, its hooks),
so that the cancellation is the last word; a flow still busy (an evaluation generating) is not waited for longer."""


def _quiet_terminal() -> TextIO:
    """From the first Ctrl-C on, the terminal shows only the stop's own lines: how the flow records its end (the stopped
    stage's `Terminated` with its traceback, the failure hook's summary, a stage's bar) still reaches the Prefect UI's
    logs, not the console. Returns the terminal's stream, for the stop's lines."""
    import logging

    terminal = sys.stderr
    streams = {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            # The console's handlers (Prefect's, the bars), not the API's
            if getattr(handler, "stream", None) in streams:
                handler.addFilter(lambda record: False)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # the flow's prints (its failure hook's)
    return terminal


def _stop(runs: dict[str, str], settled: threading.Event, stop_server: Callable[[], None], terminal: TextIO) -> None:
    """Wait for the checkpoints, record `runs` as cancelled, send the last logs, stop the server, say how to resume,
    exit."""
    from rlhf_pipeline.tasks.orchestration.parent_run import cancel_runs
    from rlhf_pipeline.trainers.runtime.stopping import grace_seconds, wait_for_checkpoints

    checkpointed = wait_for_checkpoints(grace_seconds())
    settled.wait(SETTLE_SECONDS)
    names = cancel_runs(runs, "stopped by Ctrl-C")
    with contextlib.suppress(Exception):
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()
    stop_server()
    cancelled = f"flow run {', '.join(repr(name) for name in names)} cancelled; " if names else ""
    waited = "" if checkpointed else f" (a stage did not checkpoint within {grace_seconds():.0f}s)"
    command = shlex.join(["rlhf", *sys.argv[1:]])
    print(
        f"rlhf: stopped{waited}: {cancelled}`{command}` resumes from the last checkpoint (finished stages come "
        "from the cache)",
        file=terminal,
        flush=True,
    )
    os._exit(EXIT_CODE)
