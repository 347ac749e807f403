"""In-process training stages of this checkout against an earlier commit, side by side: the cost of the launcher's \
hooks.

    python -m bench.inprocess_speed --base 521af27                # sft and ppo, 3 rounds, interleaved
    python -m bench.inprocess_speed --base 521af27 --stages sft dpo ppo --rounds 5

Both sides import their own `rlhf_pipeline` (the base commit from a `git worktree`, mapped to the package the way
pyproject.toml maps the folders, found on PYTHONPATH before the editable install's finder; the processes run outside
the checkout, whose own `rlhf_pipeline/` would shadow it) in a fresh process per measurement, and train the stage with
the tiny preset's settings on the same data and the same SFT model. The time is that of the stage's `train` call (model
loading and saving included); the table shows median, min and max per side and the ratio of medians (this checkout /
base). The verdict: every stage's ratio at most `--max-ratio` (1.05: the hooks may cost 5%); exits 1 otherwise.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("flows", "tasks", "trainers", "validators", "deployments", "configs", "data")

RUN = """
import json, sys, time
from pathlib import Path
from rlhf_pipeline.flows.params import load_params
stage, data, sft, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
params = load_params("tiny")
try:  # the module that builds the stage
    from rlhf_pipeline.tasks.stages import BY_NAME
    trainer = BY_NAME[stage].code
except ImportError:  # a base commit from before the stage table, whose trainers were rlhf_pipeline.trainers.<stage>
    import importlib
    trainer = importlib.import_module(f"rlhf_pipeline.trainers.{stage}")
arguments = {"cfg": getattr(params, stage), "data_dir": data, "out_dir": out / "out", "work_dir": out / "work"}
arguments |= {"model": params.model} if stage == "sft" else {"sft_model": sft}
arguments |= {"rewards": params.rewards, "reward_model": None} if stage == "ppo" else {}
started = time.perf_counter()
trainer.train(**arguments)
print(json.dumps({"seconds": time.perf_counter() - started}))
"""


def package_view(checkout: Path, into: Path) -> Path:
    """A folder whose `rlhf_pipeline` is `checkout`'s folders, mapped as pyproject.toml maps them."""
    package = into / "rlhf_pipeline"
    package.mkdir(parents=True)
    shutil.copy(checkout / "rlhf_pipeline" / "__init__.py", package / "__init__.py")
    for folder in FOLDERS:
        (package / folder).symlink_to(checkout / folder)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the earlier commit (e.g. the last one before the launcher)")
    parser.add_argument("--stages", nargs="+", default=["sft", "ppo"], choices=["sft", "dpo", "ppo"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-ratio", type=float, default=1.05, help="the verdict: head / base at most this")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.helpers import write_data_dir

    scratch = Path(tempfile.mkdtemp(prefix="inprocess-speed-"))
    base = scratch / "base"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True, capture_output=True
    )
    try:
        views = {"base": package_view(base, scratch / "view-base"), "head": package_view(ROOT, scratch / "view-head")}
        data = write_data_dir(scratch / "data", rows=10**9)
        sft = scratch / "sft"
        if {"dpo", "ppo"} & set(args.stages):  # one SFT model for both sides, trained by this checkout
            once = subprocess.run(
                [sys.executable, "-c", RUN, "sft", str(data), "", str(sft)],
                env={**os.environ, "PYTHONPATH": str(views["head"])},
                capture_output=True,
                text=True,
                check=True,
                cwd=scratch,
            )
            print(f"sft model for dpo/ppo: {json.loads(once.stdout.splitlines()[-1])['seconds']:.1f}s", flush=True)
        seconds: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for stage in args.stages:
                # Interleaved, alternating who goes first
                for side in ("base", "head") if round_ % 2 == 0 else ("head", "base"):
                    out = scratch / f"{side}-{stage}-{round_}"
                    done = subprocess.run(
                        [sys.executable, "-c", RUN, stage, str(data), str(sft / "out" / "model"), str(out)],
                        env={**os.environ, "PYTHONPATH": str(views[side])},
                        capture_output=True,
                        text=True,
                        cwd=scratch,
                    )
                    if done.returncode:
                        print(done.stderr[-3000:], file=sys.stderr)
                        return 1
                    took = json.loads(done.stdout.splitlines()[-1])["seconds"]
                    seconds.setdefault((stage, side), []).append(took)
                    print(f"round {round_ + 1} {stage:4} {side:4} {took:6.1f}s", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
        print(f"\nin-process stages, {args.rounds} rounds: this checkout (head) against {args.base} (base)")
        print("stage  base median [min, max]     head median [min, max]     head / base")
        slower = []
        for stage in args.stages:
            b, h = seconds[(stage, "base")], seconds[(stage, "head")]
            ratio = statistics.median(h) / statistics.median(b)
            slower += [stage] if ratio > args.max_ratio else []
            print(
                f"{stage:5}  {statistics.median(b):6.1f}s [{min(b):5.1f}, {max(b):5.1f}]    "
                f"{statistics.median(h):6.1f}s [{min(h):5.1f}, {max(h):5.1f}]    {ratio:.3f}"
            )
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{'FAIL' if slower else 'PASS'}  head / base <= {args.max_ratio} for every stage{': not ' if slower else ''}"
        f"{', '.join(slower)}"
    )
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
