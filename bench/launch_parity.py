"""The accelerate or Ray launcher against the in-process run on the embedded default: sft, then dpo and ppo from it, \
side by side.

    python -m bench.launch_parity                  # 2 CPU processes (gloo) against one process; ~6 minutes on 2 cores
    python -m bench.launch_parity --processes 4
    python -m bench.launch_parity --launcher ray   # 2 Ray Train workers on a local Ray cluster (RAY_ADDRESS: that one)

Each stage is trained twice with the tiny preset's settings, interleaved: once in this process and once under
`accelerate launch` (or as a Ray Train job) with the same global batch (per-device batch / processes for sft and dpo;
ppo's rollout batch is global already). Every model is then scored by greedy held-out exact match on the bundled
`prompts_eval`, and the table shows seconds, exact match with its 95% interval, and the launched run's difference
in points with its paired 95% interval over the prompts. The verdict is non-inferiority: for every stage the
difference's lower bound is no more than `--margin` points below zero (default 5; the launcher's parity test asks
the point estimate to be within 3 points); exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def exact_match(model_dir: Path, prompts: list, answers: list) -> list[float]:
    """Each held-out prompt's greedy exact match (1 or 0)."""
    from rlhf_pipeline.trainers.models.load import load_causal_lm
    from rlhf_pipeline.trainers.models.text import generate
    from rlhf_pipeline.trainers.rewards.sort_task import exact_match as score

    model, tokenizer = load_causal_lm(model_dir)
    return score(prompts, generate(model, tokenizer, prompts, max_new_tokens=12, batch_size=200), answer=answers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="accelerate's processes, or Ray's workers")
    parser.add_argument("--launcher", choices=("accelerate", "ray"), default="accelerate")
    parser.add_argument("--keep", type=Path, default=None, help="keep the models here (default: a temporary folder)")
    parser.add_argument("--margin", type=float, default=5.0, help="points the launched run may be worse by at most")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))

    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.tasks.config import LaunchConfig
    from rlhf_pipeline.tasks.orchestration.launcher import run_launched
    from rlhf_pipeline.tasks.stages import BY_NAME
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.rewards.metrics import bootstrap_mean
    from tests.helpers import write_data_dir

    params = load_params("tiny")
    root = args.keep or Path(tempfile.mkdtemp(prefix="launch-parity-"))
    data = write_data_dir(root / "data", rows=10**9)
    held_out = load_split(data, "prompts_eval")
    prompts, answers = held_out["prompt"], held_out["answer"]
    launch = LaunchConfig(launcher=args.launcher, num_processes=args.processes, num_workers=args.processes)
    launched = args.launcher
    per_device = {
        stage: getattr(params, stage).model_copy(
            update={"per_device_train_batch_size": getattr(params, stage).per_device_train_batch_size // args.processes}
        )
        for stage in ("sft", "dpo")
    }
    rows = []

    def build(stage: str, mode: str, arguments: dict) -> Path:
        out, work = root / mode / stage, root / mode / f"{stage}-work"
        shutil.rmtree(work, ignore_errors=True)
        arguments = {**arguments, "data_dir": data, "out_dir": out, "work_dir": work}
        started = time.perf_counter()
        if mode == "inprocess":
            BY_NAME[stage].code.train(**arguments)
        else:
            run_launched(
                stage,
                BY_NAME[stage].code.__name__,
                arguments,
                work,
                lambda values, step: None,
                lambda line: None,
                launch,
            )
        seconds = time.perf_counter() - started
        correct = exact_match(out / "model", prompts, answers)
        value = bootstrap_mean(correct, n_bootstrap=1000, seed=0)
        rows.append({"stage": stage, "mode": mode, "seconds": seconds, "correct": correct, "exact_match": value.mean})
        print(f"{stage:4} {mode:10} {seconds:7.1f}s  exact match {value.mean:.3f} [{value.low:.3f}, {value.high:.3f}]")
        return out / "model"

    sft = {
        "inprocess": build("sft", "inprocess", {"cfg": params.sft, "model": params.model}),
        launched: build("sft", launched, {"cfg": per_device["sft"], "model": params.model}),
    }
    for mode in ("inprocess", launched):
        build("dpo", mode, {"cfg": params.dpo if mode == "inprocess" else per_device["dpo"], "sft_model": sft[mode]})
    for mode in ("inprocess", launched):
        build("ppo", mode, {"cfg": params.ppo, "rewards": params.rewards, "sft_model": sft[mode], "reward_model": None})

    print(
        f"\n{args.processes} {'processes' if launched == 'accelerate' else 'Ray workers'} (gloo on CPU) against 1, the "
        "same global batch; held-out exact match on "
        f"{len(prompts)} prompts"
    )
    print("stage  in-process        launched          difference [95%]        time ratio")
    worse = []
    for stage in ("sft", "dpo", "ppo"):
        one, many = (
            next(r for r in rows if r["stage"] == stage and r["mode"] == mode) for mode in ("inprocess", launched)
        )
        gap = bootstrap_mean([b - a for a, b in zip(one["correct"], many["correct"])], n_bootstrap=1000, seed=0)
        worse += [stage] if 100 * gap.low < -args.margin else []
        print(
            f"{stage:5}  {one['exact_match']:.3f} ({one['seconds']:5.1f}s)  {many['exact_match']:.3f} "
            f"({many['seconds']:5.1f}s)  {100 * gap.mean:+6.1f} pts [{100 * gap.low:+.1f}, {100 * gap.high:+.1f}]"
            f"  {many['seconds'] / one['seconds']:5.2f}x"
        )
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    verdict = f"the launched run's lower bound >= -{args.margin:g} points for every stage"
    print(f"{'FAIL' if worse else 'PASS'}  {verdict}{': not ' + ', '.join(worse) if worse else ''}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
