"""Every policy algorithm on the embedded default, over several training seeds: what README's opening figures say.

    python -m bench.algorithms                                   # 7 policies x seeds 42 0 1: the table, the verdict
    python -m bench.algorithms --algorithms dpo ppo --seeds 42

Each run is `rlhf run --set algorithm=<a> --set <a>.seed=<seed>` as a user types it (a fresh process, the tiny preset's
settings otherwise; 42 is every stage's default seed, so seed 42 is what `rlhf run` gives), in one state folder: data,
sft, rm and the made pairs are built by the first run and reused by the others, so every policy starts from the same
sft and the seed varies the policy's training alone. `pairs` is dpo on the pairs the `pairs` stage makes from sft's
own answers (`data.preference=null`, `pairs.enabled=true`, the preset's exact-match labeller), `dpo.seed` the seed.
For each run: held-out exact match of sft and of the policy with the paired gain's 95% interval over prompts
(eval's), its seconds and the digest of the policy's published files but its card (a refactor that changes no
behaviour prints the same digests); for `pairs`, the pairs made and dropped.

The verdict is what README claims: every run's policy beats sft, the paired gain's lower bound above 0. Exits 1
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

HELD = "eval/heldout/"
ALGORITHMS = ("dpo", "kto", "orpo", "grpo", "rloo", "ppo", "pairs")


def overrides(algorithm: str, seed: int) -> list[str]:
    if algorithm == "pairs":
        return ["data.preference=null", "pairs.enabled=true", f"dpo.seed={seed}"]
    return [f"algorithm={algorithm}", f"{algorithm}.seed={seed}"]


def one_run(algorithm: str, seed: int, state: Path, log: Path) -> dict:
    seconds, artifacts = rlhf_run([*overrides(algorithm, seed), "registry.enabled=false"], state, log)
    metrics = json.loads((artifacts["eval"] / "manifest.json").read_text())["metrics"]
    made = json.loads((artifacts["pairs"] / "pairs.json").read_text())["metrics"] if "pairs" in artifacts else {}
    policy = artifacts["dpo" if algorithm == "pairs" else algorithm]
    return {"seconds": seconds, "metrics": metrics, "pairs": made, "digest": weights_digest(policy)}


def weights_digest(policy: Path) -> str:
    """The content digest of the policy's published model but its card: two checkouts that train the policy alike
    publish the same weights, config and tokenizer. The card (model/README.md) names the stage key, which hashes the
    stage's code, so a refactor that moves code changes the card and the artifact's own digest, and nothing else."""
    from rlhf_pipeline.tasks.store.artifacts import content_digest

    published = (p for p in (policy / "model").rglob("*") if p.is_file() and p.name != "README.md")
    return content_digest(policy, tuple(p.relative_to(policy).as_posix() for p in published))


def show(algorithm: str, seed: int, found: dict) -> bool:
    m = found["metrics"]
    sft, policy = m[f"{HELD}sft_exact_match"], m[f"{HELD}policy_exact_match"]
    gain = f"{HELD}exact_match_gain_vs_sft"
    ok = m[gain + "_low"] > 0
    print(
        f"{algorithm:6} {seed:5d} {found['seconds']:7.0f} {m[HELD + 'num_prompts']:8.0f} {sft:7.3f} {policy:7.3f}  "
        f"{m[gain]:+.3f} [{m[gain + '_low']:+.3f}, {m[gain + '_high']:+.3f}]  {'PASS' if ok else 'FAIL'}  "
        f"{found['digest'][:16]}",
        flush=True,
    )
    if found["pairs"]:
        print(f"       pairs made: {json.dumps(found['pairs'])}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 0, 1])
    parser.add_argument("--state", type=Path, default=None, help="the runs' state folder (default: temporary)")
    args = parser.parse_args(argv)
    root = args.state or Path(tempfile.mkdtemp(prefix="bench-algorithms-"))
    state, log = root / "state", root / "runs.log"
    root.mkdir(parents=True, exist_ok=True)
    print(f"state: {state}; log: {log}", flush=True)
    print(
        f"{'policy':6} {'seed':>5} {'seconds':>7} {'prompts':>8} {'sft':>7} {'policy':>7}  gain over sft [95%]"
        f"{'':16}weights digest"
    )
    started, policies = time.perf_counter(), {}
    for seed in args.seeds:  # interleaved: each seed of each algorithm in turn
        for algorithm in args.algorithms:
            found = one_run(algorithm, seed, state, log)
            policies.setdefault(algorithm, []).append((show(algorithm, seed, found), found["metrics"]))
    print("\npolicy  held-out exact match over the seeds (lowest - highest)")
    for algorithm, runs in policies.items():
        values = [m[f"{HELD}policy_exact_match"] for _, m in runs]
        print(f"{algorithm:6}  {min(values):.3f} - {max(values):.3f}")
    passed = [ok for runs in policies.values() for ok, _ in runs]
    seconds = time.perf_counter() - started
    print(f"\n{sum(passed)} of {len(passed)} runs beat sft (the gain's lower bound above 0); {seconds:.0f} s in all")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
