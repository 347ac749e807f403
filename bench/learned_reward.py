"""GRPO and RLOO on a learned reward, with the defaults: the embedded default with the reward model as the only reward.

    python -m bench.learned_reward                        # grpo and rloo, seeds 0 1 2: each run's figures, the verdict
    python -m bench.learned_reward --algorithms grpo --seeds 0

Each run is `rlhf run --set algorithm=<a> --set 'rewards.functions=[]' --set rewards.reward_model_weight=1
--set <a>.seed=<seed>` as a user types it (a fresh process), in one state folder: data, sft and rm are built by the
first run and reused by the others, so every seed starts from the same sft and is scored by the same reward model.
For each run: held-out exact match of sft and of the published policy with the paired gain's 95% interval (eval's,
on the rows the probes did not choose on), the probe the stage kept (`keep_best`), and each probe's exact match,
proxy reward and sqrt(KL) (the curve docs/PERFORMANCE.md shows).

The verdict is issue 41's item 6: every run's policy reaches sft + 10 points of held-out exact match. Exits 1
otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.runs import rlhf_run

MARGIN = 0.10
HELD = "eval/heldout/"


def one_run(algorithm: str, seed: int, state: Path, log: Path, extra: list[str]) -> dict:
    overrides = [
        f"algorithm={algorithm}",
        "rewards.functions=[]",
        "rewards.reward_model_weight=1",
        f"{algorithm}.seed={seed}",
        "registry.enabled=false",
        *(item.replace("<a>", algorithm) for item in extra),
    ]
    seconds, artifacts = rlhf_run(overrides, state, log)
    metrics = json.loads((artifacts["eval"] / "manifest.json").read_text())["metrics"]
    policy = artifacts[algorithm]
    curves = [json.loads(line) for line in (policy / "heldout.jsonl").read_text().splitlines()]
    outcome = json.loads((policy / "training.json").read_text())
    return {"seconds": seconds, "metrics": metrics, "curves": curves, "kept": outcome.get("kept_step")}


def show(algorithm: str, seed: int, found: dict) -> bool:
    m = found["metrics"]
    sft, policy = m[f"{HELD}sft_exact_match"], m[f"{HELD}policy_exact_match"]
    gain = f"{HELD}exact_match_gain_vs_sft"
    ok = policy >= sft + MARGIN
    print(
        f"\n{algorithm} seed {seed}: {found['seconds']:.0f} s; held-out exact match ({m[HELD + 'num_prompts']:.0f} "
        f"prompts) sft {sft:.3f}, policy {policy:.3f}, gain {m[gain]:+.3f} [{m[gain + '_low']:+.3f}, "
        f"{m[gain + '_high']:+.3f}]; kept step {found['kept']}"
    )
    print(f"  {'step':>5} {'exact match':>12} {'proxy reward':>13} {'sqrt KL':>8}   (probes: the last rows)")
    for c in found["curves"]:
        kept = "  <- kept" if c["step"] == found["kept"] else ""
        proxy = c.get("proxy_reward", float("nan"))
        print(f"  {c['step']:5d} {c['exact_match']:12.3f} {proxy:13.3f} {c['sqrt_kl']:8.3f}{kept}")
    print(f"  {'PASS' if ok else 'FAIL'}  policy {policy:.3f} >= sft {sft:.3f} + {MARGIN}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "rloo"], choices=["grpo", "rloo", "ppo"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--state", type=Path, default=None, help="the runs' state folder (default: temporary)")
    parser.add_argument(
        "--set", dest="extra", action="append", default=[], help="one more override, <a> for the algorithm (tuning)"
    )
    args = parser.parse_args(argv)
    root = args.state or Path(tempfile.mkdtemp(prefix="bench-learned-reward-"))
    state, log = root / "state", root / "runs.log"
    root.mkdir(parents=True, exist_ok=True)
    print(f"state: {state}; log: {log}", flush=True)
    started, passed = time.perf_counter(), []
    for seed in args.seeds:  # interleaved: each seed of each algorithm in turn
        for algorithm in args.algorithms:
            passed.append(show(algorithm, seed, one_run(algorithm, seed, state, log, args.extra)))
            sys.stdout.flush()
    print(f"\n{sum(passed)} of {len(passed)} runs reach sft + {MARGIN}; {time.perf_counter() - started:.0f} s in all")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
