"""Pairs made from a real model's own answers, measured: SmolLM2-135M-Instruct samples the instruction-following
prompts, IFEval's checkers label best vs worst, DPO trains on those pairs.

    python -m bench.real_pairs                                  # figures and verdict
    python -m bench.real_pairs --prompts 16 --steps 2 --eval-prompts 10 --ifeval-prompts 30 --ifbench-prompts 60

One `rlhf run --config smollm2` with `algorithm=dpo` and the `pairs` stage on (labeller: the share of a prompt's
constraints an answer follows, `rlhf_pipeline.trainers.rewards.ifeval:constraints_followed`), in a fresh state folder
(the converted GGUF and the start's answers shared, `bench.real_model.MODEL_CACHE`), then the figures from its
artifacts: the pairs made and dropped; IFEval (541 prompts), IFBench (300) and in-distribution prompt- and
instruction-level accuracy, strict and loose, of the starting policy and of the DPO policy with 95% bootstrap intervals
over prompts and the paired gains; each stage's seconds. The verdict is issue 61's, on the intervals' bounds: a seed
passes when IFEval's prompt-level strict gain has its lower bound above 0, IFBench's lower bound is at least -3 points
(a non-inferiority bound its sample can show), within 120 minutes; the bench passes when most seeds do (2 of 3).
Seeds 3, 4 and 5 by default: no recipe was chosen on them. Exits 1 otherwise."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.real_model import newest_manifest, run_or_reuse

IFBENCH_FLOOR, BUDGET = -0.03, 7200.0
STAGES = ("data", "sft", "pairs", "dpo", "eval")


def settings(args, seed: int) -> list[str]:
    """The smollm2 preset's pairs and dpo blocks (what README's command uses), with the bench's sizes; `seed` seeds
    both the pairs (which prompts, which answers) and DPO."""
    return [
        "algorithm=dpo",
        f"pairs.seed={seed}",
        f"dpo.seed={seed}",
        "pairs.enabled=true",
        f"pairs.max_prompts={args.prompts}",
        f"pairs.samples_per_prompt={args.samples}",
        f"dpo.max_steps={args.steps}",
        f"dpo.learning_rate={args.learning_rate}",
        f"dpo.beta={args.beta}",
        f"dpo.per_device_train_batch_size={args.batch}",
        f"dpo.save_steps={max(1, args.steps // 3)}",
        f"eval.max_prompts={args.eval_prompts}",
        f"eval.instruction_following.ifeval_prompts={args.ifeval_prompts}",
        f"eval.instruction_following.ifbench_prompts={args.ifbench_prompts}",
        "registry.enabled=false",
        *args.set,
    ]


def figures(state: Path) -> dict:
    evaluated = newest_manifest(state, "eval")["metrics"]
    stages = {}
    for stage in STAGES:
        manifests = sorted((state / "artifacts" / stage).glob("*/manifest.json"))
        stages[stage] = sum(json.loads(m.read_text()).get("resources", {}).get("seconds") or 0.0 for m in manifests)
    made = [json.loads(p.read_text())["metrics"] for p in sorted((state / "artifacts" / "pairs").glob("*/pairs.json"))]
    return {"metrics": evaluated, "seconds": stages, "pairs": made[-1] if made else {}}


def report(found: dict, wall: float, seed: int) -> bool:
    from rlhf_pipeline.trainers.evaluation.report import benchmark_label

    m = found["metrics"]

    def cell(name: str) -> str:
        return f"{m[name]:.3f} [{m[name + '_low']:.3f}, {m[name + '_high']:.3f}]"

    print(f"\n== seed {seed} ==\npairs: {json.dumps(found['pairs'])}")
    print(f"\n{'':36} {'start (SmolLM2-135M-Instruct)':>30} {'policy (dpo on made pairs)':>28}")
    for prefix in ("eval/heldout/", "eval/ifeval/", "eval/ifbench/", "eval/ifbench_2025_07/"):
        if f"{prefix}if_prompt_strict_gain" not in m:
            continue  # IFBench's July 2025 rows: where its wheel is installed
        print("dev split (held-out prompts)" if prefix == "eval/heldout/" else benchmark_label(m, prefix))
        for level in ("prompt_strict", "instruction_strict", "prompt_loose", "instruction_loose"):
            name = f"if_{level}"
            print(
                f"  {level.replace('_', '-'):34} {cell(f'{prefix}sft_{name}'):>30} {cell(f'{prefix}policy_{name}'):>28}"
            )
        print(f"  {'prompt-strict gain':34} {cell(prefix + 'if_prompt_strict_gain'):>30}")
    for stage, seconds in found["seconds"].items():
        print(f"{stage:6} {seconds:8.1f} s")
    low, ifbench_low = m["eval/ifeval/if_prompt_strict_gain_low"], m["eval/ifbench/if_prompt_strict_gain_low"]
    checks = {
        f"IFEval prompt-strict gain's lower bound {low:+.3f} > 0": low > 0,
        f"IFBench gain's lower bound {ifbench_low:+.3f} >= {IFBENCH_FLOOR}": ifbench_low >= IFBENCH_FLOOR,
        f"wall {wall:.0f} s <= {BUDGET:.0f} s": wall <= BUDGET,
    }
    print(f"\nwall to wall: {wall:.0f} s")
    for check, held in checks.items():
        print(f"{'PASS' if held else 'FAIL'}  {check}")
    return all(checks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512, help="training prompts sampled (of 2,000)")
    parser.add_argument("--samples", type=int, default=4, help="answers per prompt")
    parser.add_argument("--steps", type=int, default=36, help="DPO steps (8 pairs each: about one pass)")
    parser.add_argument("--batch", type=int, default=8, help="pairs per DPO step")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--eval-prompts", type=int, default=150, help="held-out prompts (of 300)")
    parser.add_argument("--ifeval-prompts", type=int, default=541, help="IFEval prompts (of 541)")
    parser.add_argument("--ifbench-prompts", type=int, default=300, help="IFBench prompts (of 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5], help="seeds (pairs.seed and dpo.seed)")
    parser.add_argument("--state", type=Path, default=None, help="parent of each seed's state (default: temporary)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe setting (rlhf run --set), repeatable"
    )
    args = parser.parse_args()
    root = args.state or Path(tempfile.mkdtemp(prefix="bench-real-pairs-"))
    passed = []
    for seed in args.seeds:
        state = root / f"seed-{seed}" / "state"
        wall = run_or_reuse(settings(args, seed), state)
        passed.append(report(figures(state), wall, seed))
    needed = len(args.seeds) // 2 + 1
    print(f"\nseeds passing: {sum(passed)} of {len(passed)} (needed: {needed})")
    raise SystemExit(0 if sum(passed) >= needed else 1)


if __name__ == "__main__":
    main()
