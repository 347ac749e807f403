"""Where a command's CPU goes, by kind of process: every process on the machine sampled every 2 s while the command
runs (each one's last reading of user + system time counts, less what it had spent before the command started; a process
that lives under 2 s may be missed).

    python -m bench.cpu_by_process -- bash .ci/run        # the suite as CI runs it (in a fresh clone)
    python -m bench.cpu_by_process --top 20 -- python -m pytest -q tests/deployments

Prints the CPU seconds of each kind (pytest workers, accelerate ranks, Ray's processes, Prefect's, MLflow's job
runner, ...) and of the busiest processes, and how busy the cores were (`/proc/stat`). Exits with the command's code.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time

KINDS = (
    ("exec(eval(sys.stdin.readline()))", "pytest worker (xdist)"),
    ("trainers.runtime.rank", "accelerate rank"),
    ("accelerate.commands.launch", "accelerate launcher"),
    ("trainers.runtime.ray_job", "Ray job driver"),
    ("mlflow.server.jobs", "MLflow job runner"),
    ("huey", "MLflow job runner"),
    ("mlflow", "MLflow server"),
    ("prefect.engine", "Prefect flow run"),
    ("prefect", "Prefect server or CLI"),
    ("rlhf_pipeline", "rlhf command"),
    ("ray", "Ray internals"),
    ("chrom", "Chromium"),
    ("-m pip", "pip"),
    ("pip install", "pip"),
    ("pytest", "pytest"),
)


def kind(command: str, name: str) -> str:
    for part, label in KINDS:
        if part in command or part in name:
            return label
    return f"other: {name}"


def busy(before: list[int], after: list[int]) -> float:
    spent = [b - a for a, b in zip(before, after)]
    return 1 - (spent[3] + spent[4]) / max(sum(spent), 1)  # idle and iowait


def cpu_line() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(x) for x in stat.readline().split()[1:]]


def main(argv: list[str] | None = None) -> int:
    import psutil

    parser = argparse.ArgumentParser(prog="python -m bench.cpu_by_process", description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=15, help="how many of the busiest processes to list")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    last: dict[tuple[int, float], list] = {}
    before = {}  # what the processes already running had spent: not the command's
    for process in psutil.process_iter(["cpu_times", "create_time"]):
        if process.info["cpu_times"] is not None:
            times = process.info["cpu_times"]
            before[(process.pid, process.info["create_time"])] = times.user + times.system
    started, first = time.time(), cpu_line()
    running = subprocess.Popen(command)
    while running.poll() is None:
        for process in psutil.process_iter(["name", "cmdline", "cpu_times", "create_time"]):
            info = process.info
            if info["cpu_times"] is None or info["create_time"] is None:
                continue
            key = (process.pid, info["create_time"])
            if key not in last:
                line = " ".join(info["cmdline"] or [])
                last[key] = [kind(line, info["name"] or ""), 0.0, line[:160] or info["name"]]
            last[key][1] = info["cpu_times"].user + info["cpu_times"].system - before.get(key, 0.0)
        time.sleep(2)
    wall = time.time() - started
    by_kind: collections.Counter = collections.Counter()
    for label, seconds, _ in last.values():
        by_kind[label] += seconds
    total = sum(by_kind.values())
    print(f"\n{wall:.0f} s wall, the cores {100 * busy(first, cpu_line()):.0f}% busy; {total:.0f} CPU s seen")
    for label, seconds in by_kind.most_common():
        if seconds >= 1:
            print(f"{seconds:9.0f} s  {100 * seconds / max(total, 1):5.1f}%  {label}")
    print(f"\nthe {args.top} busiest processes:")
    for label, seconds, line in sorted(last.values(), key=lambda row: -row[1])[: args.top]:
        print(f"{seconds:9.0f} s  {label}: {line}")
    return running.returncode


if __name__ == "__main__":
    sys.exit(main())
