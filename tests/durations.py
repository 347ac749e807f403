"""The seconds each test module takes (`tests/durations.json`), by which the suite hands its modules out longest first
to the xdist workers (tests/conftest.py), so that the two workers end together.

    python -m pytest -q --durations=0 | tee /tmp/suite.log
    python -m tests.durations /tmp/suite.log [more logs]      # rewrites tests/durations.json

A module missing from the file counts as DEFAULT_SLOW seconds when it has a slow test, else DEFAULT seconds.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
DEFAULT_SLOW = 60.0
DEFAULT = 1.0
LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def module_seconds(logs: list[str]) -> dict[str, float]:
    """Each module's seconds (calls, set-ups and tear-downs) in pytest's --durations=0 lines of `logs`."""
    seconds: dict[str, float] = {}
    for text in logs:
        for line in text.splitlines():
            if found := LINE.match(line):
                seconds[found[2]] = seconds.get(found[2], 0.0) + float(found[1])
    return seconds


def read() -> dict[str, float]:
    return json.loads(FILE.read_text()) if FILE.is_file() else {}


def main(paths: list[str]) -> int:
    seconds = module_seconds([Path(path).read_text() for path in paths])
    if not seconds:
        raise SystemExit("no --durations=0 lines in the logs given")
    rounded = {module: round(value, 1) for module, value in sorted(seconds.items(), key=lambda item: -item[1])}
    FILE.write_text(json.dumps(rounded, indent=1) + "\n")
    print(f"{len(rounded)} modules, {sum(rounded.values()):.0f} s in all -> {FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
