"""Pairs made from a real model's own answers, measured: SmolLM2-135M-Instruct samples the instruction-following
prompts, IFEval's checkers label best vs worst, DPO trains on those pairs.

    python -m bench.real_pairs                                  # ~60 minutes on 2 CPU cores; figures and verdict
    python -m bench.real_pairs --prompts 16 --steps 2 --eval-prompts 10     # a quick look (~8 minutes)

One `rlhf run --config smollm2` with `algorithm=dpo` and the `pairs` stage on (labeller: the share of a prompt's
constraints an answer follows, `rlhf_pipeline.trainers.ifeval:constraints_followed`), in a fresh state folder (the
GGUF conversion counts), then the figures from its artifacts: the pairs made and dropped, in-distribution prompt- and
instruction-level strict accuracy of the starting policy and of the DPO policy with 95% bootstrap intervals and the
paired gain, each stage's seconds. The verdict is issue 27's acceptance: prompt-level gain at least 5 points with the
lower end of its interval above 0, within 60 minutes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.real_model import newest_manifest, run_smollm2

GAIN, BUDGET = 0.05, 3600.0
STAGES = ("data", "sft", "pairs", "dpo", "eval")


def settings(args) -> list[str]:
    """The smollm2 preset's pairs and dpo blocks (what README's command uses), with the bench's sizes."""
    return [
        "algorithm=dpo",
        "pairs.enabled=true",
        f"pairs.max_prompts={args.prompts}",
        f"pairs.samples_per_prompt={args.samples}",
        f"dpo.max_steps={args.steps}",
        f"dpo.learning_rate={args.learning_rate}",
        f"dpo.beta={args.beta}",
        f"dpo.per_device_train_batch_size={args.batch}",
        f"dpo.save_steps={max(1, args.steps // 3)}",
        f"eval.max_prompts={args.eval_prompts}",
        "eval.instruction_following.ifbench_prompts=0",
        "eval.batch_size=32",
        "registry.enabled=false",
    ]


def figures(state: Path) -> dict:
    evaluated = newest_manifest(state, "eval")["metrics"]
    stages = {}
    for stage in STAGES:
        manifests = sorted((state / "artifacts" / stage).glob("*/manifest.json"))
        stages[stage] = sum(json.loads(m.read_text()).get("resources", {}).get("seconds") or 0.0 for m in manifests)
    made = [json.loads(p.read_text())["metrics"] for p in sorted((state / "artifacts" / "pairs").glob("*/pairs.json"))]
    return {"metrics": evaluated, "seconds": stages, "pairs": made[-1] if made else {}}


def report(found: dict, wall: float) -> bool:
    m = found["metrics"]

    def cell(name: str) -> str:
        return f"{m[name]:.3f} [{m[name + '_low']:.3f}, {m[name + '_high']:.3f}]"

    print(f"\npairs: {json.dumps(found['pairs'])}")
    print(f"\n{'':36} {'start (SmolLM2-135M-Instruct)':>30} {'policy (dpo on made pairs)':>28}")
    for level, what in (("if_prompt_strict", "prompt-level strict"), ("if_instruction_strict", "instruction-level")):
        print(f"{'in distribution, ' + what:36} {cell(f'eval/heldout/sft_{level}'):>30} ", end="")
        print(f"{cell(f'eval/heldout/policy_{level}'):>28}")
    print(f"{'in distribution, prompt-level gain':36} {cell('eval/heldout/if_prompt_strict_gain'):>30}")
    print(f"prompts: {int(m['eval/heldout/num_prompts'])} held out")
    for stage, seconds in found["seconds"].items():
        print(f"{stage:6} {seconds:8.1f} s")
    gain, low = m["eval/heldout/if_prompt_strict_gain"], m["eval/heldout/if_prompt_strict_gain_low"]
    checks = {
        f"in-distribution gain {gain:+.3f} >= {GAIN}": gain >= GAIN,
        f"its interval's lower end {low:+.3f} > 0": low > 0,
        f"wall {wall:.0f} s <= {BUDGET:.0f} s": wall <= BUDGET,
    }
    print(f"\nwall to wall: {wall:.0f} s")
    for check, held in checks.items():
        print(f"{'PASS' if held else 'FAIL'}  {check}")
    return all(checks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=192, help="training prompts sampled (of 2,000)")
    parser.add_argument("--samples", type=int, default=4, help="answers per prompt")
    parser.add_argument("--steps", type=int, default=30, help="DPO steps")
    parser.add_argument("--batch", type=int, default=8, help="pairs per DPO step")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--eval-prompts", type=int, default=150, help="held-out prompts (of 300)")
    parser.add_argument("--state", type=Path, default=None, help="state folder (default: a fresh temporary one)")
    args = parser.parse_args()
    state = args.state or Path(tempfile.mkdtemp(prefix="bench-real-pairs-")) / "state"
    wall = run_smollm2(settings(args), state)
    raise SystemExit(0 if report(figures(state), wall) else 1)


if __name__ == "__main__":
    main()
