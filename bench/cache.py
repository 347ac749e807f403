"""What the stage cache saves: the default pipeline's first run, an identical re-run, and a run that changes only the \
last stage.

    python -m bench.cache                 # ~6 minutes on 2 cores: one first run, then 3 rounds of the re-runs
    python -m bench.cache --rounds 5

Every run is `rlhf run` as a user types it (a fresh process, the embedded default), timed wall to wall. The first run
builds every stage into a fresh state folder. Each round then makes, interleaved:
- an identical re-run (every stage `Cached`), with Prefect's temporary server (what `rlhf run` starts when no
  PREFECT_API_URL is set) and against a running Prefect server (started here, on 127.0.0.1);
- a run that changes only `eval` (the last stage with a config; `eval.max_new_tokens`, a new value each time, so it
  re-evaluates and re-registers while data, sft, rm and ppo stay cached), again both ways.
Targets (issue 14): identical re-run <= 5% of the first run; last-stage change <= that stage's own time + 10 s, where
the stage's own time is what its manifest records (`resources.seconds`, the build alone).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.runs import ROOT, printed_artifacts, timed
from rlhf_pipeline.tasks.store.resources import free_port


def rlhf_run(env: dict, overrides: list[str], log: Path) -> tuple[float, dict[str, Path]]:
    """One `rlhf run`: wall seconds, and the artifact folder of each stage it printed."""
    command = [
        sys.executable,
        "-m",
        "rlhf_pipeline",
        "run",
        *[part for item in overrides for part in ("--set", item)],
    ]
    seconds, printed = timed(command, env, log)
    return seconds, printed_artifacts(printed)


def own_seconds(artifact: Path) -> float:
    return json.loads((artifact / "manifest.json").read_text())["resources"]["seconds"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f}s [{min(values):.1f}, {max(values):.1f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the state folder and logs here (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.runs import clean_env
    from rlhf_pipeline.deployments.local import stop, wait_until_up

    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-cache-"))
    root.mkdir(parents=True, exist_ok=True)
    log = root / "runs.log"
    base = clean_env(RLHF_STATE_DIR=str(root / "state"))
    temporary = {**base, "PREFECT_HOME": str(root / "prefect-temporary")}
    port = free_port()
    running = {**base, "PREFECT_HOME": str(root / "prefect-server"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    Path(running["PREFECT_HOME"]).mkdir(parents=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=running,
        stdout=open(root / "server.log", "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        wait_until_up(f"{running['PREFECT_API_URL']}/health", server, timeout=180)
        first, artifacts = rlhf_run(temporary, [], log)
        stage_seconds = {
            stage: own_seconds(path) for stage, path in artifacts.items() if (path / "manifest.json").is_file()
        }
        print(
            f"first run {first:.1f}s; its stages (build alone): "
            + ", ".join(f"{s} {t:.1f}s" for s, t in stage_seconds.items()),
            flush=True,
        )
        rows: dict[str, list[float]] = {}
        eval_own: dict[str, list[float]] = {"temporary": [], "running": []}
        tokens = 12
        for round_ in range(args.rounds):
            for where, env in (("temporary", temporary), ("running", running)):
                seconds, again = rlhf_run(env, [], log)
                if again != artifacts:
                    raise SystemExit(f"the identical re-run published other artifacts: {again} against {artifacts}")
                rows.setdefault(f"identical re-run, {where} server", []).append(seconds)
                print(f"round {round_ + 1}: identical re-run ({where} server) {seconds:.1f}s", flush=True)
            for where, env in (("temporary", temporary), ("running", running)):
                tokens += 1
                seconds, changed = rlhf_run(env, [f"eval.max_new_tokens={tokens}"], log)
                rebuilt = sorted(stage for stage in artifacts if changed.get(stage) != artifacts[stage])
                if rebuilt != ["eval", "registry"] and rebuilt != ["eval"]:
                    raise SystemExit(f"changing eval rebuilt {rebuilt}, not eval alone")
                rows.setdefault(f"eval changed, {where} server", []).append(seconds)
                eval_own[where].append(own_seconds(changed["eval"]))
                print(
                    f"round {round_ + 1}: eval changed ({where} server) {seconds:.1f}s, eval's own build "
                    f"{eval_own[where][-1]:.1f}s",
                    flush=True,
                )
    finally:
        stop([server])
    print(
        f"\nthe embedded default, `rlhf run` wall to wall; first run once, then {args.rounds} rounds interleaved "
        "(median [min, max])"
    )
    print(f"{'run':38} {'seconds':>22}  against the target")
    missed = []
    print(f"{'first run (every stage built)':38} {first:7.1f}s")
    for name, values in rows.items():
        median = statistics.median(values)
        if name.startswith("identical"):
            verdict = (
                f"{median / first:6.1%} of the first run (target <= 5%: "
                f"{'met' if median <= 0.05 * first else 'NOT met'})"
            )
        else:
            own = statistics.median(eval_own["temporary" if "temporary" in name else "running"])
            verdict = (
                f"eval's own {own:.1f}s + {median - own:.1f}s (target <= +10 s: "
                f"{'met' if median - own <= 10 else 'NOT met'})"
            )
        print(f"{name:38} {spread(values)}  {verdict}")
        missed += [name] if "NOT met" in verdict else []
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
