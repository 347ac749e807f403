"""What the orchestration costs: the default pipeline via `rlhf run` against the same stages as plain scripts, side by \
side.

    python -m bench.overhead              # ~8 minutes on 2 cores: 3 rounds at half the preset's training steps
    python -m bench.overhead --full       # the preset's own steps (sft 300, rm 150, dpo 200); ~14 minutes
    python -m bench.overhead --set algorithm=ppo

Both sides run in a fresh process each, timed wall to wall (imports, model building, loading and saving included), and
interleaved: pipeline, plain, pipeline, plain, ...
- pipeline: `rlhf run` on a fresh state folder (one Prefect home for all rounds, its database made first): data (Great
  Expectations checks, Parquet copies) -> sft -> rm -> dpo (the default algorithm; `--set algorithm=ppo` for ppo) ->
  eval -> registry, with Prefect (its temporary server), MLflow tracking, content-addressed artifacts and hashing.
- plain: one Python process that does the same work with no Prefect, MLflow, validation or hashing: the bundled files
  read into Parquet with `datasets`; sft, rm and dpo with TRL's `SFTTrainer`, `RewardTrainer` and `DPOTrainer`, built
  from the same resolved settings and seeds (`trl_arguments`); ppo with `trainers.ppo.train.train` (ours: TRL has no PPO
  since 1.0) and the eval with `trainers.evaluation.stage.evaluate`, called directly, as a script would.
The pipeline's breakdown comes from its manifests: each stage's build (`resources.seconds`: training, the model loads
and saves between stages, and for `data` the validation); whatever is left of the wall time is orchestration, tracking
and start-up. Target (issue 14): ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.runs import ROOT, clean_env, migrated_prefect_home, printed_artifacts, ratio_of_medians, timed

HALF = ["sft.max_steps=150", "rm.max_steps=75", "dpo.max_steps=100", "ppo.total_episodes=2560"]
STAGES = ("data", "sft", "rm", "dpo", "ppo", "eval")
TARGET = 1.25
"""Pipeline over plain scripts on the toy, by medians (issue 45: its short stages carry a fixed cost; the real model's
target, 1.05, is bench.real_overhead's). Exit 1 above it."""


def plain(out: Path, overrides: list[str]) -> None:
    """The child side: the default pipeline's stages as plain scripts; prints one JSON line of per-stage seconds."""
    started = time.perf_counter()
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.trainers.data import load_source
    from rlhf_pipeline.trainers.evaluation import stage as evaluation
    from rlhf_pipeline.trainers.models.tiny import build_model, build_tokenizer
    from rlhf_pipeline.trainers.ppo import train as ppo

    params = load_params("tiny", overrides)
    seconds = {"imports": time.perf_counter() - started}

    last = [time.perf_counter()]

    def finished(stage: str) -> None:
        now = time.perf_counter()
        seconds[stage], last[0] = now - last[0], now

    data = out / "data"
    (data / "datasets").mkdir(parents=True)
    for name, (_, spec) in params.data.sources().items():
        load_source(spec).to_parquet(str(data / "datasets" / f"{name}.parquet"))
    finished("data")

    from datasets import Dataset

    cfg = params.sft
    tokenizer = build_tokenizer()
    model = build_model(params.model.tiny, tokenizer, seed=params.model.seed)
    args = trl.SFTConfig(
        **cfg.trl_arguments(out / "sft-work"),
        max_length=cfg.max_length,
        completion_only_loss=cfg.completion_only_loss,
        packing=cfg.packing,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_parquet(str(data / "datasets" / "sft.parquet")),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(str(out / "sft"))
    finished("sft")

    rm_cfg = params.rm
    model = AutoModelForSequenceClassification.from_pretrained(str(out / "sft"), num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    args = trl.RewardConfig(
        **rm_cfg.trl_arguments(out / "rm-work"),
        max_length=rm_cfg.max_length,
        center_rewards_coefficient=rm_cfg.center_rewards_coefficient,
    )
    trainer = trl.RewardTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_parquet(str(data / "datasets" / "preference.parquet")),
        eval_dataset=Dataset.from_parquet(str(data / "datasets" / "preference_eval.parquet")),
    )
    trainer.train()
    trainer.evaluate()
    trainer.save_model(str(out / "rm"))
    finished("rm")

    policy = params.algorithm
    if policy == "dpo":  # the default
        dpo_cfg = params.dpo
        args = trl.DPOConfig(
            **dpo_cfg.trl_arguments(out / "dpo-work"),
            max_length=dpo_cfg.max_length,
            beta=dpo_cfg.beta,
            loss_type=list(dpo_cfg.loss_type),
            loss_weights=dpo_cfg.loss_weights,
            label_smoothing=dpo_cfg.label_smoothing,
        )
        model = AutoModelForCausalLM.from_pretrained(str(out / "sft"))
        trainer = trl.DPOTrainer(
            model=model,
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_parquet(str(data / "datasets" / "preference.parquet")),
        )
        trainer.train()
        trainer.save_model(str(out / "dpo" / "model"))
    elif policy == "ppo":  # ours: TRL has no PPO since 1.0
        reward_model = out / "rm" if params.rewards.uses_reward_model else None
        ppo.train(params.ppo, params.rewards, out / "sft", reward_model, data, out / "ppo", out / "ppo-work")
    else:
        raise SystemExit(f"bench.overhead compares algorithm=dpo or ppo, not {policy}")
    finished(policy)
    evaluation.evaluate(
        params.eval,
        params.model,
        out / "sft",
        out / policy / "model",
        out / "rm",
        data,
        out / "eval",
        policy_stage=policy,
    )
    finished("eval")
    print("@@plain " + json.dumps(seconds), flush=True)


def pipeline_breakdown(printed: str) -> dict[str, float]:
    """Each stage's build seconds from the manifests of the artifacts `rlhf run` printed."""
    return {
        stage: json.loads((folder / "manifest.json").read_text())["resources"]["seconds"]
        for stage, folder in printed_artifacts(printed).items()
        if (folder / "manifest.json").is_file()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="the preset's own training steps (default: half of them)")
    parser.add_argument("--plain", type=Path, default=None, help=argparse.SUPPRESS)  # the child side
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for both sides (repeatable)",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.plain is not None:
        plain(args.plain, args.overrides)
        return 0

    overrides = ([] if args.full else HALF) + args.overrides
    root = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    log = root / "runs.log"
    base = clean_env()
    sets = [part for item in overrides for part in ("--set", item)]
    walls: dict[str, list[float]] = {"pipeline": [], "plain": []}
    parts: dict[str, dict[str, list[float]]] = {"pipeline": {}, "plain": {}}
    prefect_home = migrated_prefect_home(root, log)
    for round_ in range(args.rounds):
        state = root / f"round-{round_}"
        env = {**base, "RLHF_STATE_DIR": str(state / "state"), "PREFECT_HOME": str(prefect_home)}
        seconds, printed = timed([sys.executable, "-m", "rlhf_pipeline", "run", *sets], env, log)
        walls["pipeline"].append(seconds)
        for stage, value in pipeline_breakdown(printed).items():
            parts["pipeline"].setdefault(stage, []).append(value)
        print(f"round {round_ + 1}: pipeline {seconds:.1f}s", flush=True)
        seconds, printed = timed(
            [sys.executable, "-m", "bench.overhead", "--plain", str(state / "plain"), *sets], base, log
        )
        walls["plain"].append(seconds)
        for stage, value in json.loads(printed.rsplit("@@plain ", 1)[-1].splitlines()[0]).items():
            parts["plain"].setdefault(stage, []).append(value)
        print(f"round {round_ + 1}: plain {seconds:.1f}s", flush=True)
        shutil.rmtree(state, ignore_errors=True)

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    def cell(values: list[float]) -> str:
        """A part's median, or '-' where the side did not run it (ppo under the default algorithm)."""
        return f"{median(values):9.1f}s" if values else f"{'-':>10}"

    print(
        f"\nthe embedded default{'' if args.full else ' at half its training steps (' + ', '.join(HALF) + ')'}; "
        f"{args.rounds} rounds, median [min, max]"
    )
    print(f"{'part':34} {'pipeline':>10} {'plain':>10}")
    for stage in STAGES:
        print(f"{stage + ' (build)':34} {cell(parts['pipeline'].get(stage, []))} {cell(parts['plain'].get(stage, []))}")
    built = [
        sum(parts["pipeline"][s][i] for s in parts["pipeline"] if i < len(parts["pipeline"][s]))
        for i in range(args.rounds)
    ]
    rest = [wall - inside for wall, inside in zip(walls["pipeline"], built)]
    print(f"{'registry (build)':34} {cell(parts['pipeline'].get('registry', []))} {'-':>10}")
    print(
        f"{'outside the builds':34} {median(rest):9.1f}s {median(parts['plain']['imports']):9.1f}s   (pipeline: "
        "Prefect, MLflow, start-up; plain: imports)"
    )
    for side in ("pipeline", "plain"):
        values = walls[side]
        print(f"{side + ' wall to wall':34} {median(values):9.1f}s  [{min(values):.1f}, {max(values):.1f}]")
    ratio = ratio_of_medians(walls, TARGET)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
