"""What the wall-to-wall benchmarks share: a clean environment and a timed, logged subprocess."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Prefect, MLflow or pipeline state setting (each run names its own), offline."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_", "RLHF_"))}
    return env | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"} | extra


def timed(command: list[str], env: dict, log: Path) -> tuple[float, str]:
    """Run `command` from the repository root with its output appended to `log`: wall seconds and what it printed.
    A failure stops the benchmark, naming the log."""
    started = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with {done.returncode}; see {log}")
    return seconds, log.read_text().rsplit("\n$ ", 1)[-1]


def in_fresh_process(worker: str, spec: dict, prefix: str, timeout: float | None = None) -> dict:
    """`python -c worker SPEC` from the repository root, where SPEC is a JSON file of `spec` with "out" (a temporary
    folder of the process's own, its state folder inside) added: the JSON of its last printed line, or
    {"error": ...} when it failed or ran past `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix=prefix) as out:
        path = Path(out) / "spec.json"
        path.write_text(json.dumps(spec | {"out": out}))
        try:
            done = subprocess.run(
                [sys.executable, "-c", worker, str(path)],
                env=clean_env(RLHF_STATE_DIR=str(Path(out) / "state")),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"ran past {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def printed_artifacts(printed: str) -> dict[str, Path]:
    """stage -> artifact folder, from the closing table `rlhf run` prints last (rlhf_pipeline.console.closing_table:
    rows `stage  state  seconds  artifact`)."""
    text = printed.rsplit("== finished ==", 1)[-1]
    rows = re.finditer(r"^(\w+)\s+\w+\s+\S+\s+(/\S+)$", text, re.M)
    return {match[1]: Path(match[2]) for match in rows if Path(match[2]).is_dir()}


def rlhf_command(overrides: list[str], config: str | None = None) -> list[str]:
    """`rlhf run [--config ...] --set ...` as a user types it."""
    command = [sys.executable, "-m", "rlhf_pipeline", "run", *(["--config", config] if config else [])]
    for item in overrides:
        command += ["--set", item]
    return command


def rlhf_run(
    overrides: list[str], state: Path, log: Path, config: str | None = None, **env: str
) -> tuple[float, dict[str, Path]]:
    """`rlhf_command` in `state` (its Prefect home beside it, `env` added), logged to `log`: wall seconds and each
    stage's artifact folder from the closing table."""
    env = clean_env(RLHF_STATE_DIR=str(state), PREFECT_HOME=str(state.parent / "prefect"), **env)
    seconds, printed = timed(rlhf_command(overrides, config), env, log)
    return seconds, printed_artifacts(printed)


def migrated_prefect_home(root: Path, log: Path) -> Path:
    """`root/prefect`, its Prefect database made: the home every round of a wall-to-wall bench shares, as a user's
    runs share theirs, so that a fresh database's migration (~10 s) is a one-time cost, not the pipeline's."""
    home = root / "prefect"
    timed(
        [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], clean_env(PREFECT_HOME=str(home)), log
    )
    return home


def ratio_of_medians(walls: dict[str, list[float]], target: float) -> float:
    """Pipeline over plain by the medians of their wall times, printed with each round's ratio and the verdict."""
    ratios = [one / two for one, two in zip(walls["pipeline"], walls["plain"])]
    ratio = statistics.median(walls["pipeline"]) / statistics.median(walls["plain"])
    print(
        f"ratio pipeline / plain: {ratio:.3f} by medians (per round {', '.join(f'{r:.3f}' for r in ratios)}); target "
        f"<= {target}: {'met' if ratio <= target else 'NOT met'}"
    )
    return ratio
