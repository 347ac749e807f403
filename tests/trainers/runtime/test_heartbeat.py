"""The stall watchdog tells slow from stuck (trainers/runtime/heartbeat.py): a step that computes for longer than the
limit is not cut short (a first step slower than the limit, a machine that slowed); one that waits without a beat is
stopped with every thread's stack, and a child process that computes (a launched stage's rank) counts as work."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from rlhf_pipeline.trainers.runtime.heartbeat import Stalled, beat, watching

LIMIT = 1.5


def spin(seconds: float) -> None:
    """Work that computes without a beat: a long step's forward and backward."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        sum(i * i for i in range(1000))


def test_a_step_that_computes_past_the_limit_is_not_stopped():
    said: list[str] = []
    with watching(LIMIT, "sft", said.append, poll=0.25):
        beat()  # the first step starts
        spin(4 * LIMIT)  # the first step, slower than the limit, computing all the while
        beat()
    assert said == []


def test_a_step_that_waits_without_a_beat_is_stopped_with_the_stacks_and_the_retry_is_given_twice_as_long(monkeypatch):
    from rlhf_pipeline.trainers.runtime import heartbeat

    monkeypatch.setattr(heartbeat, "_STALLS", {})
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(Stalled, match="rm: stalled"):
        with watching(LIMIT, "rm", said.append, poll=0.25):
            beat()
            for _ in range(100):  # a socket, a lock or a dead collective: nothing computes
                time.sleep(0.1)
    assert time.monotonic() - started < LIMIT + 3
    assert said and said[0].startswith("rm: no progress for") and "test_a_step_that_waits_without_a_beat" in said[0]
    said.clear()
    with watching(LIMIT, "rm", said.append, poll=0.25):  # the retry: not the same attempt again, unsaid
        beat()
        time.sleep(LIMIT + 0.5)  # past the first limit, within the doubled one
        beat()
    assert said == [
        f"rm: 1 attempt(s) stalled before this one: its stall limit is {2 * LIMIT:.0f}s (doubled each time)"
    ]


def test_a_child_process_that_computes_counts_as_work_and_one_that_waits_does_not():
    """A launched stage's ranks compute in processes of their own while the watched thread waits for them."""
    said: list[str] = []
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        with watching(LIMIT, "sft", said.append, poll=0.25):
            beat()
            busy.wait(30)
    finally:
        busy.kill()
    assert said == []
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(Stalled):
            with watching(LIMIT, "sft", said.append, poll=0.25):
                beat()
                for _ in range(100):
                    threading.Event().wait(0.1)
    finally:
        idle.kill()
        idle.wait()


def test_the_data_stage_beats_as_it_reads_rows_so_its_watchdog_watches_it():
    import datasets

    from rlhf_pipeline.trainers.runtime import heartbeat
    from rlhf_pipeline.validators.formats import record_batches

    rows = datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(10)]})
    with watching(LIMIT, "data", lambda line: None, poll=0.25):
        assert threading.get_ident() not in heartbeat._BEATS  # not watched yet
        assert sum(batch.num_rows for batch in record_batches(rows, ["text"], batch_rows=3)) == 10
        assert threading.get_ident() in heartbeat._BEATS  # armed: a hang from here on is caught
