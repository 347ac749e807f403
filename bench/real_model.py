"""Learning on a real model, measured: SmolLM2-135M-Instruct through GRPO with IFEval's checkers as the reward.

    python -m bench.real_model                       # ~60 minutes on 2 CPU cores; prints the figures and the verdict
    python -m bench.real_model --steps 10 --eval-prompts 40 --ifbench-prompts 20     # a quicker look

One `rlhf run --config smollm2` in a fresh state folder (the GGUF file converted there too, so the wall time counts
it), with the settings below, then the figures from its artifacts: in-distribution (the held-out prompts of
data/ifeval, requests no training prompt uses) and IFBench (out of distribution) strict accuracy of the starting
policy (the chat model as shipped) and the policy, with 95% bootstrap intervals and the paired gain; each stage's
seconds, and the tokens/s of GRPO's build. The verdict is issue 25's acceptance: in-distribution prompt-level gain
at least 5 points with the lower end of its interval above 0, IFBench no more than 2 points lower, all within 60
minutes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.runs import clean_env, timed

GAIN, IFBENCH_SLACK, BUDGET = 0.05, 0.02, 3600.0


def settings(args) -> list[str]:
    return [
        f"grpo.max_steps={args.steps}",
        f"grpo.learning_rate={args.learning_rate}",
        f"grpo.save_steps={max(1, args.steps // 3)}",
        f"eval.max_prompts={args.eval_prompts}",
        f"eval.instruction_following.ifbench_prompts={args.ifbench_prompts}",
        "eval.batch_size=32",  # generation's throughput on 2 cores: 16 left eval at 23 min of the hour
        "registry.enabled=false",
    ]


def newest_manifest(state: Path, stage: str) -> dict:
    manifests = sorted((state / "artifacts" / stage).glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(manifests[-1].read_text())


def figures(state: Path) -> dict:
    """The run's figures, from its manifests (eval's metrics; each stage's seconds; GRPO's tokens)."""
    evaluated = newest_manifest(state, "eval")["metrics"]
    stages = {}
    for stage in ("data", "sft", "grpo", "eval"):
        manifest = newest_manifest(state, stage)
        stages[stage] = {"seconds": manifest.get("resources", {}).get("seconds")}
    history = sorted((state / "artifacts" / "grpo").glob("*/history.jsonl"))
    tokens = 0.0
    if history:
        rows = [json.loads(line) for line in history[-1].read_text().splitlines()]
        tokens = max((r["metrics"].get("grpo/train/num_tokens", 0.0) for r in rows), default=0.0)
    stages["grpo"]["tokens"] = tokens
    return {"metrics": evaluated, "stages": stages}


def report(found: dict, wall: float) -> bool:
    m = found["metrics"]

    def cell(name: str) -> str:
        return f"{m[name]:.3f} [{m[name + '_low']:.3f}, {m[name + '_high']:.3f}]"

    print(f"\n{'':36} {'start (SmolLM2-135M-Instruct)':>30} {'policy (grpo)':>24}")
    for prefix, label in (("eval/heldout/", "in distribution"), ("eval/ifbench/", "IFBench")):
        for level, what in (
            ("if_prompt_strict", "prompt-level strict"),
            ("if_instruction_strict", "instruction-level"),
        ):
            print(f"{label + ', ' + what:36} {cell(f'{prefix}sft_{level}'):>30} {cell(f'{prefix}policy_{level}'):>24}")
        print(f"{label + ', prompt-level gain':36} {cell(prefix + 'if_prompt_strict_gain'):>30}")
    families = sorted({n.split("/")[-1] for n in m if n.startswith("eval/heldout/if_family/policy/")})
    for family in families:
        start, policy = m[f"eval/heldout/if_family/sft/{family}"], m[f"eval/heldout/if_family/policy/{family}"]
        print(f"  in distribution, {family:19} {start:30.3f} {policy:24.3f}")
    print(
        f"\nprompts: {int(m['eval/heldout/num_prompts'])} in distribution, "
        f"{int(m['eval/ifbench/num_prompts'])} IFBench ({int(m['eval/ifbench/num_refused'])} left out: checkers this "
        "machine cannot run)"
    )
    for stage, info in found["stages"].items():
        seconds = info["seconds"] or 0.0
        rate = f", {info['tokens'] / seconds:.1f} tokens/s" if info.get("tokens") and seconds else ""
        print(f"{stage:6} {seconds:8.1f} s{rate}")
    gain = m["eval/heldout/if_prompt_strict_gain"]
    ifbench_drop = m["eval/ifbench/sft_if_prompt_strict"] - m["eval/ifbench/policy_if_prompt_strict"]
    checks = {
        f"in-distribution gain {gain:+.3f} >= {GAIN}": gain >= GAIN,
        f"its interval's lower end {m['eval/heldout/if_prompt_strict_gain_low']:+.3f} > 0": m[
            "eval/heldout/if_prompt_strict_gain_low"
        ]
        > 0,
        f"IFBench drop {ifbench_drop:+.3f} <= {IFBENCH_SLACK}": ifbench_drop <= IFBENCH_SLACK,
        f"wall {wall:.0f} s <= {BUDGET:.0f} s": wall <= BUDGET,
    }
    print(f"\nwall to wall: {wall:.0f} s")
    for check, held in checks.items():
        print(f"{'PASS' if held else 'FAIL'}  {check}")
    return all(checks.values())


def run_smollm2(overrides: list[str], state: Path) -> float:
    """One `rlhf run --config smollm2 --set ...` in `state` (its Prefect home beside it, its log in run.log there);
    the wall seconds, from start to exit."""
    command = ["python", "-m", "rlhf_pipeline", "run", "--config", "smollm2"]
    for item in overrides:
        command += ["--set", item]
    env = clean_env(RLHF_STATE_DIR=str(state), PREFECT_HOME=str(state.parent / "prefect"))
    log = state.parent / "run.log"
    state.parent.mkdir(parents=True, exist_ok=True)
    print(f"{' '.join(command)}\nstate: {state}; log: {log}", flush=True)
    started = time.perf_counter()
    timed(command, env, log)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps (4 prompts x 4 samples each)")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--eval-prompts", type=int, default=150, help="held-out prompts (of 300)")
    parser.add_argument("--ifbench-prompts", type=int, default=60, help="IFBench prompts (of 294)")
    parser.add_argument("--state", type=Path, default=None, help="state folder (default: a fresh temporary one)")
    args = parser.parse_args()
    state = args.state or Path(tempfile.mkdtemp(prefix="bench-real-model-")) / "state"
    wall = run_smollm2(settings(args), state)
    raise SystemExit(0 if report(figures(state), wall) else 1)


if __name__ == "__main__":
    main()
