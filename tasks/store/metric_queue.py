"""A stage's metrics on their way to MLflow: queued, sent by a thread of their own, kept through a tracking-server
outage and sent in order when it answers again. Training never waits for the tracking server (an MLflow call retries
for minutes before it fails, docs/ARCHITECTURE.md, MLflow); each value is also in the stage's `history.jsonl` first,
so nothing is lost even if the server never comes back.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import deque
from typing import Callable

MAX_BATCH = 1000
"""Metric values in one `log_batch` call: MLflow's own limit."""

Row = tuple[int, dict[str, float], int]
"""(timestamp in ms, values, step): the time is when the value was made, not when it reached MLflow."""


class MetricQueue:
    """`put` returns at once; a thread sends the rows in order with `send(rows)`, and on a failure keeps them and tries
    again with a growing pause (1 s to `max_pause`). `close(timeout)` waits for the queue to empty and returns how
    many rows are still unsent."""

    def __init__(
        self,
        send: Callable[[list[Row]], None],
        log: Callable[[str], None],
        stage: str,
        max_pause: float = 30.0,
    ) -> None:
        self._send, self._log, self._stage, self._max_pause = send, log, stage, max_pause
        self._rows: deque[Row] = deque()
        self._changed = threading.Condition()
        self._closed = False
        self.down_since: float | None = None
        """When the tracking server stopped taking rows (None: it takes them)."""
        self.sent = 0
        context = contextvars.copy_context()  # the caller's Prefect run context: its log lines reach the run's log
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name=f"mlflow-metrics-{stage}", daemon=True
        )
        self._thread.start()

    def put(self, values: dict[str, float], step: int) -> None:
        with self._changed:
            self._rows.append((int(time.time() * 1000), dict(values), step))
            self._changed.notify()

    def pending(self) -> int:
        with self._changed:
            return len(self._rows)

    def close(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for every row to reach MLflow; the rows still unsent (0: all sent)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout)
        return self.pending()

    def abandon(self) -> None:
        """Drop what is unsent (it is in the stage's history file) and let the thread end."""
        with self._changed:
            self._closed = True
            self._rows.clear()
            self._changed.notify_all()

    def _next_batch(self) -> list[Row] | None:
        with self._changed:
            while not self._rows and not self._closed:
                self._changed.wait()
            if not self._rows:
                return None
            batch, count = [], 0
            for row in self._rows:
                if batch and count + len(row[1]) > MAX_BATCH:
                    break
                batch.append(row)
                count += len(row[1])
            return batch

    def _run(self) -> None:
        pause = 1.0
        while (batch := self._next_batch()) is not None:
            try:
                self._send(batch)
            except Exception as exc:  # any failure of the tracking server: keep the rows, try again
                if self.down_since is None:
                    self.down_since = time.time()
                    self._log(
                        f"{self._stage}: MLflow did not take the metrics of step {batch[0][2]} "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); training goes on, "
                        "and they are sent when it answers again"
                    )
                time.sleep(pause)
                pause = min(pause * 2, self._max_pause)
                continue
            with self._changed:
                for _ in batch:
                    self._rows.popleft()
            self.sent += len(batch)
            if self.down_since is not None:
                self._log(
                    f"{self._stage}: MLflow answers again after {time.time() - self.down_since:.0f}s; the metrics kept "
                    f"meanwhile are sent (up to step {batch[-1][2]})"
                )
                self.down_since, pause = None, 1.0
