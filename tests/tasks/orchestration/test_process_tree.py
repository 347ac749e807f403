"""The launcher stops every process of a launch, also those that left its tree: a process whose parent exited is no
longer under the launch (a Ray worker the raylet of a local cluster started while it stopped, in CI of d4f3a20)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil

from rlhf_pipeline.tasks.orchestration.launcher import LAUNCH_ENV, ProcessTree

# The launch: it starts an orphan (a sleeper whose parent exits at once) when it starts and another when it is asked to
# stop, as it exits, and writes each orphan's pid into the file it is given.
LAUNCH = """
import signal, subprocess, sys, time

def orphan():
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    quiet = "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL"  # not the pipe its parent's output is read from
    sleeper = f"import subprocess; print(subprocess.Popen({sleep!r}, {quiet}).pid)"
    pid = subprocess.run([sys.executable, "-c", sleeper], capture_output=True, text=True, check=True).stdout.strip()
    with open(sys.argv[1], "a") as pids:
        pids.write(pid + "\\n")

def stopping(*_):
    orphan()
    sys.exit(0)

signal.signal(signal.SIGTERM, stopping)
orphan()
time.sleep(600)
"""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_launch_is_killed_with_the_processes_that_left_its_tree_before_and_while_it_stopped(tmp_path):
    pids = tmp_path / "pids"
    marker = uuid.uuid4().hex
    launch = subprocess.Popen([sys.executable, "-c", LAUNCH, str(pids)], env={**os.environ, LAUNCH_ENV: marker})
    try:
        deadline = time.time() + 60
        while not pids.is_file() and time.time() < deadline:
            time.sleep(0.05)
        [first] = [int(pid) for pid in pids.read_text().split()]
        tree = ProcessTree(launch.pid, marker)
        tree.refresh()
        assert running(first) and psutil.Process(first) not in tree.known  # it is under no process of the launch
        said: list[str] = []
        tree.kill(5, said.append, "sft")
        launch.wait(timeout=10)
        orphans = [int(pid) for pid in pids.read_text().split()]
        assert len(orphans) == 2 and not any(running(pid) for pid in orphans), orphans
        assert said == []  # each went on SIGTERM
    finally:
        launch.kill()
        for pid in pids.read_text().split() if pids.is_file() else ():
            if running(int(pid)):
                psutil.Process(int(pid)).kill()
