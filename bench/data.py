"""The `data` stage at scale: seconds, rows/s and peak RSS of `validators.stage.train` on preference files of 10k to \
5M rows.

    python -m bench.data                              # 10k, 100k, 1M and 5M rows; ~4 minutes on 2 cores
    python -m bench.data --sizes 1M --repeats 5
    python -m bench.data --sizes 10k,100k --no-broken

Each size gets one generated prompt/chosen/rejected jsonl file (~150 bytes a row) that stands in for the run's
`preference` dataset (the other datasets stay the bundled ones, as a default run has them), and the stage's trainer
runs on it in a fresh process per repetition, so that its peak RSS (the child's ru_maxrss, from wait4) is that run's
alone; `datasets` gets an empty cache each time, as on new data. RSS counts the pages of the memory-mapped Arrow
cache the run has read (file-backed, dropped first under memory pressure); "anon" is the peak of the rest, the heap
(RssAnon, polled every 20 ms). A second file of the same size breaks three rows far
apart (a blank chosen, two chosen == rejected): the run must fail and its report name exactly those 0-based rows.
Generated files live in a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECONDS_1M = 20
"""The 1M-row clean file's median seconds must stay under this (issue 14)."""
PEAK_MB = 1_500
"""Every run's peak RSS must stay under this, flat in the rows (issue 14: < 1.5 GB at 5M rows). Exit 1 past either."""

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"10k": 10_000, "100k": 100_000, "1M": 1_000_000, "5M": 5_000_000}
TOPICS = ("billing", "login", "shipping", "refunds", "the mobile app", "invoices", "passwords", "delivery times")


def row(i: int) -> str:
    """One ~150-byte preference row; the ticket number keeps every prompt distinct (the leakage check's worst case)."""
    topic = TOPICS[i % len(TOPICS)]
    return (
        f'{{"prompt": "Summarise support ticket {i:07d} about {topic} in one line: ", '
        f'"chosen": "The customer cannot use {topic} and asks for a fix.", '
        f'"rejected": "Ticket {i} is about {topic}, maybe."}}\n'
    )


def broken_rows(num_rows: int) -> dict[int, str]:
    """0-based row -> the line that breaks it: rows in the first third, the middle and the very end."""
    blank, same_middle, same_last = num_rows // 3 + 1, num_rows // 2 + 7, num_rows - 1
    return {
        blank: '{"prompt": "Summarise this ticket: ", "chosen": "   ", "rejected": "No."}\n',
        same_middle: '{"prompt": "Summarise that ticket: ", "chosen": "Same answer.", "rejected": "Same answer."}\n',
        same_last: '{"prompt": "Summarise the last ticket: ", "chosen": "Last.", "rejected": "Last."}\n',
    }


def write_preferences(path: Path, num_rows: int, broken: dict[int, str]) -> Path:
    with open(path, "w") as f:
        for start in range(0, num_rows, 100_000):
            f.write("".join(broken.get(i) or row(i) for i in range(start, min(start + 100_000, num_rows))))
    return path


def child(path: Path, scratch: Path, result: Path) -> None:
    """One stage run in this process; writes seconds and, for a failing run, the rows its report names."""
    from rlhf_pipeline.trainers.data import DataConfig, DatasetSpec
    from rlhf_pipeline.validators.stage import train

    config = DataConfig(preference=DatasetSpec(path=str(path)))
    started = time.perf_counter()
    named: dict[str, list[int]] = {}
    try:
        metrics = train(config, None, {}, scratch / "out", scratch / "work", pairs_for={"preference": ("rm", "dpo")})
    except ValueError:
        metrics = {}
        report = json.loads((scratch / "work" / "report" / "preference" / "validation.json").read_text())
        named = {
            rule["rule"]: [example["row"] for example in rule["examples"]]
            for rule in report["rules"]
            if not rule["success"]
        }
    seconds = time.perf_counter() - started
    result.write_text(json.dumps({"seconds": seconds, "rows": metrics.get("data/preference/rows"), "named": named}))


def run_once(path: Path, root: Path) -> dict:
    """The stage in a fresh process; its own peak RSS comes from wait4's rusage (KiB on Linux)."""
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    result = scratch / "result.json"
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(scratch / "hf-cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    command = [sys.executable, "-m", "bench.data", "--child", str(path), str(scratch), str(result)]
    anon = 0
    with open(scratch / "log.txt", "wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            anon = max(anon, _anon_kib(process.pid))
            time.sleep(0.02)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(
            f"the stage run on {path} exited {process.returncode}:\n{(scratch / 'log.txt').read_text()[-3000:]}"
        )
    outcome = {**json.loads(result.read_text()), "peak_rss_mb": usage.ru_maxrss / 1024, "peak_anon_mb": anon / 1024}
    shutil.rmtree(scratch, ignore_errors=True)
    return outcome


def _anon_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("RssAnon:")), 0)
    except OSError:  # exited between wait4 and here
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)} (or a row count)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per size under 1M rows (1M and more run min(repeats, 3) and 1 times)",
    )
    parser.add_argument("--no-broken", action="store_true", help="skip the run on the file with broken rows")
    parser.add_argument("--child", nargs=3, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0

    sizes = [SIZES[size] if size in SIZES else int(size) for size in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-data-"))
    table = []
    try:
        for num_rows in sizes:
            repeats = args.repeats if num_rows < 1_000_000 else (min(args.repeats, 3) if num_rows == 1_000_000 else 1)
            clean = write_preferences(root / f"clean-{num_rows}.jsonl", num_rows, {})
            runs = [run_once(clean, root) for _ in range(repeats)]
            clean.unlink()
            assert all(run["rows"] == num_rows for run in runs), runs
            seconds = [run["seconds"] for run in runs]
            median = statistics.median(seconds)
            line = {
                "rows": num_rows,
                "variant": "clean",
                "runs": repeats,
                "median_s": median,
                "min_s": min(seconds),
                "max_s": max(seconds),
            }
            peaks = {key: max(run[key] for run in runs) for key in ("peak_rss_mb", "peak_anon_mb")}
            table.append({**line, "rows_per_s": num_rows / median, **peaks, "named": "-"})
            print(_format(table[-1]), flush=True)
            if args.no_broken:
                continue
            broken = broken_rows(num_rows)
            run = run_once(write_preferences(root / f"broken-{num_rows}.jsonl", num_rows, broken), root)
            (root / f"broken-{num_rows}.jsonl").unlink()
            expected = {"text_not_blank": [min(broken)], "chosen_differs_from_rejected": sorted(broken)[1:]}
            named = "ok" if run["named"] == expected else f"WRONG: {run['named']} (expected {expected})"
            line = {
                "rows": num_rows,
                "variant": "broken",
                "runs": 1,
                "median_s": run["seconds"],
                "min_s": run["seconds"],
                "max_s": run["seconds"],
            }
            table.append(
                {
                    **line,
                    "rows_per_s": num_rows / run["seconds"],
                    "peak_rss_mb": run["peak_rss_mb"],
                    "peak_anon_mb": run["peak_anon_mb"],
                    "named": named,
                }
            )
            print(_format(table[-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{'rows':>9}  {'variant':7}  {'runs':>4}  {'median s':>8}  {'min-max s':>13}  {'rows/s':>9}  "
        f"{'peak RSS MB':>11}  {'anon MB':>7}  rows named"
    )
    for line in table:
        print(_format(line))
    missed = []
    for line in table:
        if line["rows"] == 1_000_000 and line["variant"] == "clean" and line["median_s"] >= SECONDS_1M:
            missed.append(f"1M rows took {line['median_s']:.1f} s (target < {SECONDS_1M} s)")
        if line["peak_rss_mb"] >= PEAK_MB:
            missed.append(f"{line['rows']:,} rows ({line['variant']}) peaked at {line['peak_rss_mb']:,.0f} MB")
    print("\n".join(missed) if missed else f"targets met: 1M rows < {SECONDS_1M} s, every peak RSS < {PEAK_MB:,} MB")
    return 0 if all(line["named"] in ("-", "ok") for line in table) and not missed else 1


def _format(line: dict) -> str:
    spread = f"{line['min_s']:.1f}-{line['max_s']:.1f}"
    return (
        f"{line['rows']:>9,}  {line['variant']:7}  {line['runs']:>4}  {line['median_s']:8.1f}  {spread:>13}  "
        f"{line['rows_per_s']:>9,.0f}  {line['peak_rss_mb']:>11,.0f}  {line['peak_anon_mb']:>7,.0f}  {line['named']}"
    )


if __name__ == "__main__":
    sys.exit(main())
