"""What `rlhf run` and `rlhf eval` do around the flow: the console a person reads, the state folders, the imports warmed
up while the temporary Prefect server starts, the garbage collector settled after them, and the closing table
(docs/PERFORMANCE.md, `bench.cache`: what each saves)."""

from __future__ import annotations

import gc
import os

from rlhf_pipeline.deployments.env import CONSOLE_SETTINGS


def console(args) -> None:
    """The terminal a person reads (CONSOLE_SETTINGS, and the console's bars), set when `rlhf run` starts (before its
    parameters load, so the temporary server starts with it): not for a command that only checks or prints, nor with
    --verbose."""
    if not getattr(args, "verbose", False):
        os.environ.update(CONSOLE_SETTINGS)
        from rlhf_pipeline import console

        console.install()


def make_state_folders() -> None:
    """Create the folders the environment names (a fresh PREFECT_HOME, RLHF_STATE_DIR, a SQLite tracking
    URI's folder): Prefect's temporary server cannot open its database in a folder that does not exist,
    and waits two minutes before it says so."""
    from pathlib import Path

    folders = [os.environ.get("PREFECT_HOME"), os.environ.get("RLHF_STATE_DIR")]
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("sqlite:///"):
        folders.append(str(Path(uri.removeprefix("sqlite:///")).parent))
    for folder in filter(None, folders):
        Path(folder).expanduser().mkdir(parents=True, exist_ok=True)


def warm_up_imports() -> None:
    """Import MLflow and matplotlib in the background while Prefect starts its temporary server: a fully cached run
    waits less (docs/PERFORMANCE.md, `bench.cache`)."""
    import importlib
    import threading

    def load() -> None:
        # The SQLite store's module (SQLAlchemy, alembic) is slow to import: here, not on the flow's path.
        names = ["mlflow.tracking", "mlflow.entities", "matplotlib.figure", "matplotlib.backends.backend_agg"]
        if not os.environ.get("MLFLOW_TRACKING_URI", "sqlite:").startswith(("http:", "https:", "databricks")):
            names.append("mlflow.store.tracking.sqlalchemy_store")
        for name in names:
            importlib.import_module(name)

    threading.Thread(target=load, name="warm-up-imports", daemon=True).start()


def settle_heap() -> None:
    """After `rlhf run`'s imports: what they made is moved out of the cyclic garbage collector's reach (`gc.freeze`)
    and collection starts again; imports make next to no garbage (docs/ARCHITECTURE.md, the collector's passes). A
    build freezes and unfreezes its own way (`tasks.store.resources.frozen_heap`). No-op when collection is on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def report(summary: dict) -> None:
    # Send the last log lines to the API now: the temporary server stops at exit,
    # before Prefect's own flush would run, and the late lines would fail noisily.
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    from rlhf_pipeline.console import closing_table

    print("\n" + closing_table(summary))
