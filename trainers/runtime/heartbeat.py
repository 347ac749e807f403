"""A stage's heartbeat, and the watchdog that fails a stage whose heart stopped.

Work that moves says so with `beat()`: every training step and metrics log (through `progress.emit`, which the
launcher also calls for each progress line its ranks send), every batch of answers generated, every batch of answers
scored. Beats are counted per thread: the thread that runs a stage's build is the one its watchdog watches.

`watching(limit)` arms a watchdog around a build once the build has beaten once (loading weights or validating data
before that is not judged). When no beat came for `limit` seconds, or for ten times the longest gap between two beats
seen so far when that is longer (a stage whose steps take minutes is not cut short), it writes every thread's stack
to the log and raises `Stalled` in the build's thread. `Stalled` is transient: the task's retry resumes from the last
checkpoint. A thread blocked inside a C call (a socket read with no timeout) gets it when the call returns; its stack
is in the log at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

LOG = logging.getLogger(__name__)
_BEATS: dict[int, tuple[float, float]] = {}
"""thread id -> (last beat, longest gap between two beats), monotonic seconds."""
SCALE = 10.0


class Stalled(RuntimeError):
    """No beat for longer than the stall limit: the stage hung (a stuck reward function, a dead collective)."""


def beat() -> None:
    """The work of this thread moved."""
    now, ident = time.monotonic(), threading.get_ident()
    last, longest = _BEATS.get(ident, (now, 0.0))
    _BEATS[ident] = (now, max(longest, now - last))


def stacks() -> str:
    """Every thread's stack, as a person reads a hang."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        lines.append(f'Thread "{names.get(ident, ident)}":\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(lines)


@contextlib.contextmanager
def watching(limit: float | None, stage: str, log: Callable[[str], None], poll: float = 1.0) -> Iterator[None]:
    """Watch the calling thread's beats while the body runs (`limit` None: not at all)."""
    if not limit:
        yield
        return
    watched, done, ending = threading.get_ident(), threading.Event(), threading.Lock()
    _BEATS.pop(watched, None)
    said: list[str] = []

    def watch() -> None:
        while not done.wait(poll):
            if watched not in _BEATS:
                continue  # not beaten yet: still loading
            last, longest = _BEATS[watched]
            allowed = max(limit, SCALE * longest)
            if time.monotonic() - last <= allowed:
                continue
            with ending:  # never into a build that has just ended
                if done.is_set():
                    return
                said.append(
                    f"{stage}: no progress for {time.monotonic() - last:.0f}s (limit {allowed:.0f}s: "
                    f"retry.stall_seconds, or {SCALE:g}x the longest step so far); the stacks of every thread:\n"
                    f"{stacks()}"
                )
                # At once on the console; into the stage's own log (the Prefect UI's) when its thread wakes up.
                LOG.warning(said[0])
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(watched), ctypes.py_object(Stalled))
                return

    watcher = threading.Thread(target=watch, name=f"{stage}-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    except Stalled:
        log(said[0] if said else f"{stage}: stalled")
        raise Stalled(
            f"{stage}: stalled: no progress within the limit (its stacks are in the log above); the retry resumes "
            "from its last checkpoint"
        ) from None
    finally:
        with ending:
            done.set()
        watcher.join()
        _BEATS.pop(watched, None)
