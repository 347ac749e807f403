"""A Prefect database migrated once per machine and Prefect version, which the tests' fresh Prefect homes start from: a
server on a new home spends ~5 s of its ~9 s start migrating its database here (docs/PERFORMANCE.md, the test suite).

The copy is the database `prefect server database upgrade` makes, nothing more: every server still checks its
migrations and registers its block types at start, as on a user's new home.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

DATABASE = "prefect.db"
"""The file a Prefect home's default database URL names (sqlite+aiosqlite:///$PREFECT_HOME/prefect.db)."""


def seeded(home: Path) -> str:
    """`home`, made if missing, with a migrated database unless it has one; returns it as a string, for an
    environment's PREFECT_HOME."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / DATABASE).exists():
        shutil.copyfile(template(), home / DATABASE)
    return str(home)


def template() -> Path:
    """The migrated database for this Prefect version, made by the first process that asks (the others wait for it)."""
    from filelock import FileLock

    folder = Path(tempfile.gettempdir()) / "rlhf-tests-prefect"
    folder.mkdir(exist_ok=True)
    path = folder / f"prefect-{version('prefect')}.db"
    with FileLock(folder / "make.lock"):
        if path.exists():
            return path
        with tempfile.TemporaryDirectory(dir=folder) as home:
            env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_SERVER_DATABASE")}
            subprocess.run(
                [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                env={**env, "PREFECT_HOME": home},
                check=True,
                capture_output=True,
                timeout=300,
            )
            os.replace(Path(home) / DATABASE, path)
    return path
