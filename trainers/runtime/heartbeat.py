"""A stage's heartbeat, and the watchdog that fails a stage whose heart stopped.

Work that moves says so with `beat()`: every training step and metrics log (through `progress.emit`, which the
launcher also calls for each progress line its ranks send), every batch of answers generated, every batch of answers
scored. Beats are counted per thread: the thread that runs a stage's build is the one its watchdog watches.

`watching(limit)` arms a watchdog around a build once the build has beaten once (loading weights or validating data
before that is not judged). Work that computes is not stuck, however long a step takes: while the build's thread or
this process's child processes (a launched stage's ranks) use the CPU (`BUSY_SHARE` of a core or more between two
polls), the watchdog counts it as a beat, so a first step slower than the limit, or a machine that slowed, is not cut
short. When neither a beat nor computing came for `limit` seconds, or for ten times the longest gap between two beats
seen so far when that is longer, it writes every thread's stack to the log and raises `Stalled` in the build's
thread: what it catches is work that waits (a socket, a lock, a dead collective, a sleep), not work that spins.
`Stalled` is transient: the task's retry resumes from the last checkpoint, with its limit doubled for each attempt
of the same build (its stage key) that stalled in this process (its log says so). A thread blocked inside a C call
(a socket read with no timeout) gets it when the call returns; its stack is in the log at once.
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
_STALLS: dict[str, int] = {}
"""what is built (a stage key) -> how many of its attempts in this process stalled: each doubles the next one's limit
(said in its log)."""
BUSY_SHARE = 0.1
"""Share of one core the build's thread and child processes must use between two polls to count as computing."""


class Stalled(RuntimeError):
    """No beat for longer than the stall limit: the stage hung (a stuck reward function, a dead collective)."""


def beat() -> None:
    """The work of this thread moved."""
    now, ident = time.monotonic(), threading.get_ident()
    last, longest = _BEATS.get(ident, (now, 0.0))
    _BEATS[ident] = (now, max(longest, now - last))


def busy_seconds(native_id: int) -> float:
    """CPU seconds used so far by the thread `native_id` of this process and by this process's child processes (a
    launched stage's ranks): what computes for a build."""
    import os

    import psutil

    total = 0.0
    with contextlib.suppress(OSError, IndexError, ValueError):
        with open(f"/proc/self/task/{native_id}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def stacks() -> str:
    """Every thread's stack, as a person reads a hang."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        lines.append(f'Thread "{names.get(ident, ident)}":\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(lines)


@contextlib.contextmanager
def watching(
    limit: float | None, stage: str, log: Callable[[str], None], poll: float = 1.0, work: str | None = None
) -> Iterator[None]:
    """Watch the calling thread's beats while the body runs (`limit` None: not at all). `work` names what is built
    (its stage key): an earlier attempt of it that stalled doubles the limit (default: the stage)."""
    if not limit:
        yield
        return
    work = work or stage
    if stalls := _STALLS.get(work, 0):  # a retry is not the attempt that stalled again, unsaid
        limit *= 2**stalls
        log(
            f"{stage}: {stalls} attempt(s) stalled before this one: its stall limit is {limit:.0f}s (doubled each time)"
        )
    watched, done, ending = threading.get_ident(), threading.Event(), threading.Lock()
    _BEATS.pop(watched, None)
    said: list[str] = []

    native = threading.current_thread().native_id or 0
    busy = [busy_seconds(native), time.monotonic()]

    def watch() -> None:
        while not done.wait(poll):
            used, now = busy_seconds(native), time.monotonic()
            computing = used - busy[0] >= BUSY_SHARE * (now - busy[1])
            busy[:] = used, now
            if watched not in _BEATS:
                continue  # not beaten yet: still loading
            if computing:  # slow, not stuck: as if it had beaten
                _BEATS[watched] = (now, _BEATS[watched][1])
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
        _STALLS[work] = _STALLS.get(work, 0) + 1
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
