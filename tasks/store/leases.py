"""Leases: a run's pin on every artifact it built or reused, so that `rlhf gc` never removes one while the run may
still read it.

A lease is a file `<stage>/.leases/<key>/<holder>.json` (the holder: the run's MLflow parent run id), written under
the key's lock when the run builds or reuses the artifact and removed when the run ends. gc removes an artifact only
under the same lock and only when no live lease names it, so a run that reused `sft` between gc's listing and its
deletion keeps it. A lease of a process that died on this machine is not live; one written on another machine is
(gc cannot see that process), until its run ends and removes it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import psutil

LEASES = ".leases"


def lease(stage_root: Path, key: str, holder: str) -> None:
    """Pin `<stage_root>/<key>` for `holder` (call with the key's lock held)."""
    folder = stage_root / LEASES / key
    folder.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    (folder / f"{holder}.json").write_text(json.dumps(record))


def lease_input(folder: Path, artifact_root: Path, holder: str, wait_seconds: float = 60.0) -> bool:
    """Pin a folder a run reads without building it (`rlhf eval <folder>`'s models) when it is a stage artifact of
    `artifact_root` (`<artifact_root>/<stage>/<key>`), under the key's lock as a build pins its own; whether it did.
    Raises when gc removed it before the lock was had."""
    from filelock import FileLock

    folder, root = folder.resolve(), artifact_root.resolve()
    if folder.parent.parent != root:
        return False
    stage_root = folder.parent
    (stage_root / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(stage_root / ".locks" / f"{folder.name}.lock", timeout=wait_seconds):
        if not folder.is_dir():
            raise ValueError(f"{folder} was removed (rlhf gc) before this run could pin it")
        lease(stage_root, folder.name, holder)
    return True


def release(artifact_root: Path, holder: str) -> None:
    """Unpin everything `holder` pinned (its run ended)."""
    for path in artifact_root.glob(f"*/{LEASES}/*/{holder}.json"):
        path.unlink(missing_ok=True)


def live_leases(stage_root: Path, key: str) -> list[str]:
    """The holders whose lease on `<stage_root>/<key>` still counts (call with the key's lock held)."""
    live = []
    for path in sorted((stage_root / LEASES / key).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("host") != socket.gethostname() or psutil.pid_exists(int(record.get("pid", 0))):
            live.append(path.stem)
    return live
